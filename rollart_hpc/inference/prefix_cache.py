"""Which cached KV rows hold a prefix of a new prompt: the index of the built-in engine's prefix cache.

An agent turn re-sends the whole episode so far, so turn k+1's prompt starts with turn k's prompt and
reply. When a request ends, the engine moves its KV row into one of `capacity` retained rows and
records here the tokens that row holds (every token that went through the model: prompt and output
but the last sampled token). A new prompt is looked up by token blocks: the chained hash of each full
block of `block` tokens maps to the entries whose tokens start with those blocks, so a lookup walks the
prompt's blocks until one misses, then extends the match token by token inside the deepest entry. The
engine copies that many cached positions into the request's row and prefills only the rest.

Invariants:
- at most `capacity` entries, one per retained row; a row is reused for the least recently used entry
  (`victim`), and its entry is dropped first, so the index never points at a row's older contents;
- an entry that a hit matches whole is dropped (its row stays readable until the next store): the
  request that extends it is stored when it ends, so one episode holds one row, not one per turn;
- a match is never the whole prompt (at least one token is left to compute the next-token logits);
- `clear()` (the engine calls it when a weight swap invalidates the cache) drops every entry.

Pure bookkeeping: no tensors; the engine owns the rows and the copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK = 16


@dataclass
class PrefixStats:
    """Lookups and tokens over the engine's lifetime."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0  # prompt tokens copied from the cache instead of prefilled
    prompt_tokens: int = 0  # prompt tokens of every looked-up request
    stored: int = 0
    evicted: int = 0
    invalidations: int = 0

    def to_dict(self) -> dict[str, int | float]:
        saved = self.tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0
        return {**self.__dict__, "saved_fraction": saved}


def _block_hashes(tokens: list[int], block: int) -> list[int]:
    """The chained hash of every full block: h_k covers tokens[: (k + 1) * block]."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[start : start + block])))
        hashes.append(h)
    return hashes


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n, limit = 0, min(len(a), len(b), limit)
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixIndex:
    """The token prefixes held by `capacity` retained KV rows (see the module docstring)."""

    def __init__(self, capacity: int, block: int = BLOCK) -> None:
        if capacity < 0 or block < 1:
            raise ValueError(f"prefix cache: capacity >= 0 and block >= 1 required, got {capacity}, {block}")
        self.capacity = capacity
        self.block = block
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # row -> tokens, least recent first
        self._hashes: dict[int, list[int]] = {}  # row -> its block hashes
        self._by_hash: dict[int, set[int]] = {}  # block hash -> rows whose tokens start with those blocks

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, int] | None:
        """(row, matched tokens) of the longest cached prefix of `prompt` (at most len(prompt) - 1 tokens,
        at least one block), or None. A hit makes its entry the most recently used."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        candidates: set[int] = set()
        for h in _block_hashes(prompt, self.block):
            rows = self._by_hash.get(h)
            if not rows:
                break
            candidates = rows
        best, matched = -1, 0
        for row in candidates:  # the entries that share the deepest block: the longest match wins
            n = _common_prefix(self._entries[row], prompt, len(prompt) - 1)
            if n > matched:
                best, matched = row, n
        if matched < self.block:  # no shared block, a hash collision, or a one-block prompt
            return None
        cached = self._entries[best]
        if matched == len(cached):  # the new request extends it and is stored in its place when it ends
            self.drop(best)
        else:
            self._entries.move_to_end(best)
        self.stats.hits += 1
        self.stats.tokens_reused += matched
        return best, matched

    def victim(self, free_rows: list[int]) -> int:
        """The row to store the next entry in: a free one, else the least recently used (dropped)."""
        for row in free_rows:
            if row not in self._entries:
                return row
        row = next(iter(self._entries))
        self.drop(row)
        self.stats.evicted += 1
        return row

    def store(self, row: int, tokens: list[int]) -> None:
        """Record that `row` now holds the KV of `tokens` (replacing whatever it held)."""
        self.drop(row)
        hashes = _block_hashes(tokens, self.block)
        self._entries[row] = list(tokens)
        self._hashes[row] = hashes
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(row)
        self.stats.stored += 1

    def drop(self, row: int) -> None:
        if self._entries.pop(row, None) is None:
            return
        for h in self._hashes.pop(row):
            rows = self._by_hash[h]
            rows.discard(row)
            if not rows:
                del self._by_hash[h]

    def clear(self) -> None:
        if self._entries:
            self.stats.invalidations += 1
        self._entries.clear()
        self._hashes.clear()
        self._by_hash.clear()
