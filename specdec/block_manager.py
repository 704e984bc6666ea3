"""Paged KV block accounting: reference counts, prefix caching, reserve/commit. No tensors.

A block holds `block_size` consecutive tokens of one sequence. A block full of committed tokens
gets a hash chained from its predecessor's, so a later sequence with the same prefix reuses it.
Unreferenced hashed blocks stay cached and are evicted least-recently-used first; with a
`resident` budget (the CPU) they are evicted before a block never written is taken, once that
many blocks have been written: the pool's pages are committed as its blocks are first written,
and a cache that always took fresh blocks first grew a CPU server by the whole pool.

Speculation is "reserve n slots, then commit m of them": `reserve` makes the block table cover
the slots a step will write; `commit` records how many of them became real tokens, hashes blocks
that just filled up and returns the blocks beyond what the sequence now needs.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from specdec.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 resident: int | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        # Blocks that may be written before cached ones are recycled rather than a fresh one
        # taken (None: no limit). Requests never wait for it: with nothing cached, fresh
        # blocks are taken up to the pool.
        self.resident = num_blocks if resident is None else max(1, min(resident, num_blocks))
        self.written = 0  # blocks ever taken: ids below it (fresh ones go out in id order)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Unreferenced blocks with no cached content, taken from the right: the block freed last
        # is reused first, so a server touches only as many blocks as it has held at once (the
        # CPU's KV pool is committed page by page, and cycling through it would make the process
        # grow to the whole pool).
        self.free: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed, LRU order
        self.hash_to_block: dict[int, int] = {}
        # Per sequence: hashes of its committed full blocks, in order.
        self._seq_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        need = -(-num_slots // self.block_size)
        return max(0, need - len(seq.block_table))

    # -- allocation -----------------------------------------------------------------------
    def _take(self) -> int:
        # The deque's right end holds the blocks freed last, then the fresh ones in id order.
        if self.free and (self.free[-1] < self.written or not self.cached
                          or self.written < self.resident):
            b = self.free.pop()
            self.written = max(self.written, b + 1)
        else:
            b, _ = self.cached.popitem(last=False)
            h = self.block_hash[b]
            if h is not None and self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hash[b] = None
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} released twice"
        if self.ref_counts[b] == 0:
            if self.block_hash[b] is not None:
                self.cached[b] = None
            else:
                self.free.append(b)

    def _hash_chain(self, tokens: list[int], upto_blocks: int, start: list[int]) -> list[int]:
        hashes = list(start)
        bs = self.block_size
        for i in range(len(hashes), upto_blocks):
            prev = hashes[-1] if hashes else 0
            hashes.append(hash((prev, tuple(tokens[i * bs:(i + 1) * bs]))))
        return hashes

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks its cached prefix. Returns the number of tokens hit.

        At least one token is always left to compute, so the step produces logits."""
        assert not seq.block_table and seq.num_computed == 0
        tokens = seq.tokens
        self._seq_hashes[seq.request_id] = []
        if not self.enable_prefix_caching or not seq.params.cache_prompt:
            return 0
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hash_chain(tokens, max_blocks, [])
        hit = 0
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            if self.ref_counts[b] == 0:
                self.cached.pop(b, None)
            self.ref_counts[b] += 1
            seq.block_table.append(b)
            hit += 1
        self._seq_hashes[seq.request_id] = hashes[:hit]
        seq.num_computed = hit * self.block_size
        if not seq.output_token_ids:
            seq.num_cached_prompt_tokens = seq.num_computed
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += min(seq.num_computed, seq.num_prompt_tokens)
        return seq.num_computed

    def can_reserve(self, seq: Sequence, num_new_slots: int) -> bool:
        return self.blocks_needed(seq, seq.num_computed + num_new_slots) <= self.num_free

    def reserve(self, seq: Sequence, num_new_slots: int) -> bool:
        """Make the block table cover slots num_computed .. num_computed + num_new_slots - 1."""
        need = self.blocks_needed(seq, seq.num_computed + num_new_slots)
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def commit(self, seq: Sequence, num_computed: int, in_flight: int = 0) -> None:
        """The sequence's first `num_computed` tokens now have their KV in place; blocks past
        them are released, except those of `in_flight` more slots a launched step writes."""
        seq.num_computed = num_computed
        keep = -(-(num_computed + in_flight) // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)

    def _register_full_blocks(self, seq: Sequence) -> None:
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        # Only blocks whose tokens the sequence already holds: a verification step commits its
        # accepted drafts' KV before they join the tokens (specdec/commit.py), and a
        # block they fill is hashed at the next commit, over its whole token run.
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        if full <= len(hashes):
            return
        hashes[:] = self._hash_chain(seq.tokens, full, hashes)
        for i in range(len(hashes)):
            b, h = seq.block_table[i], hashes[i]
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.block_hash[b] = h
                self.hash_to_block[h] = b

    def free_seq(self, seq: Sequence) -> None:
        """Return all of a sequence's blocks (finish, abort or preemption)."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_computed = 0
        self._seq_hashes.pop(seq.request_id, None)

    def slot(self, seq: Sequence, index: int) -> int:
        """The KV slot of token `index` of a sequence (its block must be reserved)."""
        return seq.block_table[index // self.block_size] * self.block_size + (
            index % self.block_size)

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        """The KV slots of tokens start .. start + count - 1 (as `slot`, for a whole run)."""
        bs, table = self.block_size, seq.block_table
        return [table[i // bs] * bs + i % bs for i in range(start, start + count)]
