"""Paged KV-cache bookkeeping: which physical blocks each sequence owns, and prefix caching.

A block holds `block_size` consecutive token positions of one sequence for every layer. Blocks are
reference counted so that a block can be shared: by a forked table, or by every sequence whose prompt
starts with the same full blocks of tokens (prefix caching).

Prefix caching: a full block whose keys/values are computed is registered under a key made of its
tokens and the key of the block before it, so equal keys mean equal token prefixes, hence equal
keys/values. When its last owner frees it, it stays in the free pool with its contents and its key;
a later sequence with the same prefix takes it back instead of recomputing it. The free pool is
LRU: a block is overwritten only when it is the least recently freed.

A chain of keys starts at a root: None, or a request's cache salt (vLLM's cache_salt), so that requests
with different salts never share a block, however alike their prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self.free_pool: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: list[Optional[tuple]] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}
        self.num_cache_hits = 0   # blocks reused, for tests and stats

    @property
    def num_free(self) -> int:
        return len(self.free_pool)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        b, _ = self.free_pool.popitem(last=False)
        key = self.block_key[b]
        if key is not None:
            # Its old contents are about to be overwritten.
            if self.cached.get(key) == b:
                del self.cached[key]
            self.block_key[b] = None
        self.refcount[b] = 1
        return b

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` in place to cover num_tokens positions. All or nothing: False leaves it unchanged."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._take_free())
        return True

    def fork(self, table: list[int]) -> list[int]:
        """A second owner of the same blocks (e.g. parallel samples sharing a prompt)."""
        for b in table:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"fork of free block {b}")
            self.refcount[b] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        for b in reversed(table):
            if self.refcount[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free_pool[b] = None     # most recently freed: evicted last
        table.clear()

    # ---- prefix caching ----------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int], n_blocks: int, start_key=None, start: int = 0):
        key = start_key
        bs = self.block_size
        for i in range(start, n_blocks):
            key = (hash(key), tuple(tokens[i * bs:(i + 1) * bs]))
            yield key

    def match_prefix(self, tokens: Sequence[int], root=None) -> tuple[list[int], Optional[tuple]]:
        """Take the cached blocks that hold the longest full-block prefix of `tokens` under the key chain
        that starts at `root`, leaving at least one token uncomputed (its logits are needed). Returns
        (block table, key of its last block, or `root` when none matched)."""
        table: list[int] = []
        last = root
        if not self.enable_prefix_caching:
            return table, last
        for key in self._keys(tokens, (len(tokens) - 1) // self.block_size, root):
            b = self.cached.get(key)
            if b is None:
                break
            if self.refcount[b] == 0:
                del self.free_pool[b]
            self.refcount[b] += 1
            table.append(b)
            last = key
        self.num_cache_hits += len(table)
        return table, last

    def register(self, table: list[int], tokens: Sequence[int], num_computed: int, num_registered: int,
                 last_key) -> tuple[int, Optional[tuple]]:
        """Publish the newly completed full blocks of a sequence; returns the new (count, last key)."""
        if not self.enable_prefix_caching:
            return num_registered, last_key
        full = min(num_computed // self.block_size, len(table))
        key = last_key
        for i, key in enumerate(self._keys(tokens, full, last_key, num_registered), start=num_registered):
            b = table[i]
            if self.block_key[b] is None and key not in self.cached:
                self.block_key[b] = key
                self.cached[key] = b
        return max(full, num_registered), key
