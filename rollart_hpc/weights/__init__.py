"""Weight sync from the publishing trainer to rollout ranks: standalone process group, static bucket
layout, asynchronous bucketed broadcast (see `publisher.py` for the protocol)."""
