"""Weight sync from the publishing trainer to rollout ranks: the transport interface and its
implementations (`transport.py`), over a standalone process group with a static bucket layout and an
asynchronous bucketed broadcast (`group.py`, `buckets.py`, `publisher.py` for the protocol)."""
