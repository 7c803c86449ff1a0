"""A replica's prefix cache, as the simulator models vLLM's automatic prefix caching.

The KV cache is kept in blocks of `BLOCK_TOKENS` tokens; a block is identified by the
prompt up to and including it, so a request reuses the leading blocks it shares with
anything the replica computed before, and only those (the first miss ends the match).
Blocks are evicted least recently used first once `capacity_blocks` are held.

Simplification: vLLM keeps cached blocks only in KV memory that running sequences do not
use; here the whole KV cache's worth of blocks stays cached, so the model is generous to
caching under memory pressure, equally for every routing it compares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

# vLLM's default KV block size.
BLOCK_TOKENS = 16


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Iterable[Hashable]) -> int:
        """How many of `blocks`, from the first, are cached (now the most recently used)."""
        cached = 0
        for block in blocks:
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            cached += 1
        return cached

    def insert(self, blocks: Iterable[Hashable]) -> None:
        """A request computed `blocks`: cached from now on, least recently used out."""
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
