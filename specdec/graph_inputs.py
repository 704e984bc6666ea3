"""The graph runner's padded inputs (specdec/cuda_graphs.py): the buckets a step is padded to,
the flat staging layout of a bucket's inputs, packing a step into it on the host, and the
model's inputs and attention metadata as views of the device copy.

Padding and why it is harmless: specdec/cuda_graphs.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec.attention import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
TOKENS_PER_SEQ = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPH_TOKENS = 2048


@dataclass(frozen=True)
class Layout:
    """Offsets of one bucket's inputs in the flat staging buffers."""

    batch: int  # B
    q: int  # Q, query rows per sequence
    width: int  # W, block-table columns

    @property
    def tokens(self) -> int:
        return self.batch * self.q

    # int64 buffer: ids [T] | positions [T] | slots [T] | mask offsets [B] | logits rows [T]
    @property
    def n64(self) -> int:
        return 4 * self.tokens + self.batch

    # int32 buffer: query_start [B + 1] | context lens [B] | seq lens [B] | tables [B * W]
    @property
    def n32(self) -> int:
        return 3 * self.batch + 1 + self.batch * self.width

    @property
    def nmask(self) -> int:
        return self.batch * self.q * self.q if self.q > 1 else 0

    @property
    def rows_at(self) -> int:
        return 3 * self.tokens + self.batch

    # One staging area per step, one transfer (each costs the GPU microseconds between
    # kernels): int64 part, then int32, then the masks.
    @property
    def at32(self) -> int:  # byte offset of the int32 part
        return 8 * self.n64

    @property
    def at_mask(self) -> int:
        return self.at32 + 4 * self.n32

    @property
    def nbytes(self) -> int:
        return self.at_mask + self.nmask


def pick_bucket(segments: list[Any], width: int, block_size: int,
                batch_sizes: tuple[int, ...] = BATCH_SIZES,
                tokens_per_seq: tuple[int, ...] = TOKENS_PER_SEQ,
                max_tokens: int = MAX_GRAPH_TOKENS) -> tuple[int, int] | None:
    """(B, Q) of the smallest bucket holding the step, or None if none does."""
    if not segments:
        return None
    b = next((x for x in batch_sizes if x >= len(segments)), None)
    qmax = max(len(s.tokens) for s in segments)
    q = next((x for x in tokens_per_seq if x >= qmax), None)
    if b is None or q is None or b * q > max_tokens:
        return None
    for s in segments:
        if len(s.block_table) > width or s.context_len + q > width * block_size:
            return None
    return b, q


def pack_step(
    segments: list[Any],
    lay: Layout,
    h64: np.ndarray,  # [>= lay.n64] int64
    h32: np.ndarray,  # [>= lay.n32] int32
    hmask: np.ndarray,  # [>= lay.nmask] bool
    tables_written: list[list[int] | None] | None = None,
) -> tuple[int, list[int], bool]:
    """Write a step's padded inputs in `lay`'s layout; return (logits rows, row offsets, whether
    those rows are the bucket's first rows in order).

    `tables_written`: per row of the block tables (B entries, updated here), what the buffer
    holds from the last call, or None where that is unknown (another layout wrote there).
    Rows that did not change are not written again: a block table grows by one block every
    block_size tokens, and 16 rows of 60-odd blocks cost a third of this function. None for
    the whole argument writes every row."""
    t, b, q, w = lay.tokens, lay.batch, lay.q, lay.width
    # Padded rows are assembled as host lists and written with one numpy call per buffer
    # region: per-segment numpy calls cost more than the few ints of a decode step.
    ids, pos, slots = [0] * t, [0] * t, [-1] * t
    rows: list[int] = []
    offsets: list[int] = []
    for i, s in enumerate(segments):
        r0, n = i * q, len(s.tokens)
        ids[r0:r0 + n] = s.tokens
        pos[r0:r0 + n] = s.positions
        slots[r0:r0 + n] = s.slots
        offsets.append(len(rows))
        rows += [r0 + r for r in s.logits_rows]
    mask_offs = list(range(0, b * q * q, q * q)) if q > 1 else [-1] * b
    h64[0:3 * t + b] = ids + pos + slots + mask_offs
    h64[lay.rows_at:lay.rows_at + len(rows)] = rows
    ctx = [s.context_len for s in segments] + [0] * (b - len(segments))
    h32[0:3 * b + 1] = list(range(0, (b + 1) * q, q)) + ctx + [c + q for c in ctx]
    tables = h32[3 * b + 1:lay.n32].reshape(b, w)
    written = [None] * b if tables_written is None else tables_written
    for i in range(b):
        table = segments[i].block_table if i < len(segments) else []
        old = written[i]
        if table != old:
            tables[i, :len(table)] = table
            tables[i, len(table):w if old is None else len(old)] = 0
            written[i] = list(table)
    if q > 1:
        mask = hmask[:lay.nmask].reshape(b, q, q)
        mask[:] = np.eye(q, dtype=bool)
        # Drafters repeat a few tree shapes and their masks are shared objects
        # (drafters.tree.ancestor_mask_of): one write per distinct mask, not per segment.
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, s in enumerate(segments):
            key = id(s.mask) if s.mask is not None else -len(s.tokens)
            groups.setdefault(key, (s, []))[1].append(i)
        for s, idx in groups.values():
            n = len(s.tokens)
            mask[idx, :n, :n] = (s.mask.numpy() if s.mask is not None
                                 else np.tri(n, dtype=bool))
    return len(rows), offsets, rows == list(range(len(rows)))


def padded_metadata(lay: Layout, d64: torch.Tensor, d32: torch.Tensor, dmask: torch.Tensor,
                    block_size: int, context_lens_host: tuple[int, ...] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) as views of the staging buffers in `lay`'s layout.

    Host-side fields describe the bucket, not the step (the Triton kernel reads the step from
    device memory); pass the step's `context_lens_host` for backends that read them."""
    t, b, q, w = lay.tokens, lay.batch, lay.q, lay.width
    offs = tuple(i * q * q for i in range(b)) if q > 1 else (-1,) * b
    meta = AttentionMetadata(
        query_start=d32[0:b + 1], context_lens=d32[b + 1:2 * b + 1],
        seq_lens=d32[2 * b + 1:3 * b + 1], block_tables=d32[3 * b + 1:lay.n32].view(b, w),
        slot_mapping=d64[2 * t:3 * t], custom_mask=dmask[:lay.nmask] if q > 1 else None,
        mask_offsets=d64[3 * t:3 * t + b], q_lens_host=(q,) * b,
        context_lens_host=context_lens_host or (0,) * b, mask_offsets_host=offs,
        block_size=block_size)
    return d64[0:t], d64[t:2 * t], meta
