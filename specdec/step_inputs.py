"""Where a step plan becomes the model's inputs.

- `plan_segments`: the plan and its drafts as `Segment`s, one per sequence: a prefill chunk, or
  a decode's root plus its draft tree (positions by depth, an ancestor mask, KV slots).
- `eager_inputs`: segments as device tensors for an eager pass (two host tensors, two copies,
  every field a view of them).
- Graph-padded inputs (specdec/cuda_graphs.py runs them): the buckets a step is padded to
  (`pick_bucket`), the flat staging layout of a bucket's inputs (`Layout`), packing a step into
  it on the host (`pack_step`), and the model's inputs and attention metadata as views of the
  device copy (`padded_metadata`); padding, and why it is harmless: specdec/cuda_graphs.py.
- Chained steps (specdec/chaining.py): `chained_segments` stages one from the host's view,
  `advance_staged` moves its staged inputs on by its predecessor's verdict on the device, and
  `staged_segments` does the same on the CPU and reads the result back as segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from drafters.tree import row_shape
from specdec.attention_metadata import AttentionMetadata
from specdec.scheduler import StepPlan

if TYPE_CHECKING:
    from specdec.block_manager import BlockManager
    from specdec.sequence import Sequence
    from specdec.verdict import TreeShape


@dataclass
class Segment:
    """One sequence's query rows in a step."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    context_len: int  # KV entries already present before these rows
    block_table: list[int]
    mask: torch.Tensor | None = None  # [q, q] bool, None = causal
    logits_rows: tuple[int, ...] = ()  # local rows whose logits the step needs


@dataclass
class Draft:
    """One decode's draft tree for a step, as host lists (empty: a plain decode)."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None  # [n, V]: the distributions drawn from; None: greedy


NO_DRAFT = Draft([], [])

@dataclass
class StepOutput:
    """What a pass returns."""

    logits: torch.Tensor  # [sum of logits rows, V] float32
    row_offsets: list[int]  # per segment, where its logits rows start
    # With capture_layers: features of EVERY query row, the captured layers' residual streams
    # then the final normed hidden state, concatenated: [T, (len(capture_layers) + 1) * hidden].
    features: torch.Tensor | None = None
    query_offsets: list[int] | None = None  # per segment, where its query rows start


BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
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


def bucket(batch: int, rows_per_seq: int, batch_sizes: tuple[int, ...] = BATCH_SIZES,
           tokens_per_seq: tuple[int, ...] = TOKENS_PER_SEQ,
           max_tokens: int = MAX_GRAPH_TOKENS) -> tuple[int, int] | None:
    """(B, Q) of the smallest bucket of `batch` sequences of `rows_per_seq` rows each, or None
    if none holds them (the step runs eagerly)."""
    b = next((x for x in batch_sizes if x >= batch), None)
    q = next((x for x in tokens_per_seq if x >= rows_per_seq), None)
    if b is None or q is None or b * q > max_tokens:
        return None
    return b, q


def pick_bucket(segments: list[Any], width: int, block_size: int,
                batch_sizes: tuple[int, ...] = BATCH_SIZES,
                tokens_per_seq: tuple[int, ...] = TOKENS_PER_SEQ,
                max_tokens: int = MAX_GRAPH_TOKENS) -> tuple[int, int] | None:
    """(B, Q) of the smallest bucket holding the step, or None if none does."""
    if not segments:
        return None
    bq = bucket(len(segments), max(len(s.tokens) for s in segments), batch_sizes,
                tokens_per_seq, max_tokens)
    if bq is None:
        return None
    b, q = bq
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


def plan_segments(plan: StepPlan, drafts: list[Draft], blocks: BlockManager,
                  vocab: int) -> list[Segment]:
    """Prefill chunks first (a completing chunk's last row has logits), then decodes."""
    segs: list[Segment] = []
    for p in plan.prefills:
        s, n = p.seq, p.num_tokens
        c = s.num_computed
        segs.append(Segment(s.tokens[c:c + n], list(range(c, c + n)), blocks.slots(s, c, n), c,
                            list(s.block_table), logits_rows=(n - 1,) if p.completes else ()))
    for d, dr in zip(plan.decodes, drafts):
        s, c, toks = d.seq, d.seq.num_computed, dr.tokens
        if toks and not 0 <= min(toks) <= max(toks) < vocab:
            raise ValueError(f"a draft token of {s.request_id} is outside the vocabulary")
        shape = row_shape(dr.parents)
        segs.append(Segment([s.last_token] + toks, [c + x for x in shape.offsets],
                            blocks.slots(s, c, 1 + len(toks)), c, s.block_table,
                            mask=shape.mask, logits_rows=shape.logits_rows))
    return segs


def chained_segments(seqs: list[Sequence], shape: TreeShape, blocks: BlockManager
                     ) -> list[Segment]:
    """A chained step's segments as the host stages them before the step before is read back
    (specdec/chaining.py). Plain decoding (no nodes): that step emits one token per sequence,
    so positions and slots are known and only the token is the device's. With nodes: each
    sequence's context as the host knows it, no tokens and no slots (`advance_staged` moves
    them on)."""
    if not shape.parents:
        return [Segment([0], [s.num_computed + 1], [blocks.slot(s, s.num_computed + 1)],
                        s.num_computed + 1, s.block_table, logits_rows=(0,)) for s in seqs]
    rs = row_shape(shape.parents)
    return [Segment([0] * shape.rows, [s.num_computed + x for x in rs.offsets],
                    [-1] * shape.rows, s.num_computed, s.block_table, mask=rs.mask,
                    logits_rows=rs.logits_rows) for s in seqs]


def eager_inputs(segments: list[Segment], device: torch.device, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids [T], positions [T], attention metadata) of a ragged batch."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    starts = [0]
    masks: list[torch.Tensor] = []
    mask_offsets: list[int] = []
    moff = 0
    for s in segments:
        ids += s.tokens
        pos += s.positions
        slots += s.slots
        starts.append(len(ids))
        if s.mask is None:
            mask_offsets.append(-1)
        else:
            mask_offsets.append(moff)
            masks.append(s.mask.reshape(-1))
            moff += s.mask.numel()
    b, t = len(segments), len(ids)
    width = max((len(s.block_table) for s in segments), default=1) or 1
    q_lens = tuple(len(s.tokens) for s in segments)
    ctx = tuple(s.context_len for s in segments)
    i32 = starts + list(ctx) + [c + q for c, q in zip(ctx, q_lens)]
    for s in segments:
        i32 += s.block_table + [0] * (width - len(s.block_table))
    d32 = torch.tensor(i32, dtype=torch.int32).to(device)  # [3B + 1 + B * W]
    d64 = torch.tensor(ids + pos + slots + mask_offsets, dtype=torch.long).to(device)  # [3T + B]
    meta = AttentionMetadata(
        query_start=d32[0:b + 1], context_lens=d32[b + 1:2 * b + 1],
        seq_lens=d32[2 * b + 1:3 * b + 1], block_tables=d32[3 * b + 1:].view(b, width),
        slot_mapping=d64[2 * t:3 * t],
        custom_mask=torch.cat(masks).to(device) if masks else None,
        mask_offsets=d64[3 * t:], q_lens_host=q_lens, context_lens_host=ctx,
        mask_offsets_host=tuple(mask_offsets), block_size=block_size,
    )
    return d64[0:t], d64[t:2 * t], meta


def advance_staged(d64: torch.Tensor, d32: torch.Tensor, lay: Layout, block_size: int,
                   n: int, shape: TreeShape, emitted: torch.Tensor, num: torch.Tensor,
                   rows: torch.Tensor, drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a step staged from the host's stale view forward on the device, in place.

    The staging buffers (`Layout`) hold n trees of `shape`, staged with
    each sequence's context as the host knew it when the step before launched (no tokens, no
    slots). Sequence i was row rows[i] of that step, which emitted `num` tokens per row
    (`emitted`, [rows, k + 1]): its context and positions grow by that count, its root is the
    last emitted token, its nodes' tokens come from `drafts` (specdec/device_drafts.py,
    already moved past that step) and row r's KV slot is context + r's, through the block
    table. Returns the step's (input tokens, KV slots), each [n, m]."""
    t, b, q, w = lay.tokens, lay.batch, lay.q, lay.width
    m = shape.rows
    ar = shape.tensors(d64.device)[3]
    add = num.index_select(0, rows)  # [n]
    root = emitted.index_select(0, rows).gather(1, (add - 1)[:, None])  # [n, 1]
    ctx = d32[b + 1:2 * b + 1][:n]
    ctx += add.to(torch.int32)
    d32[2 * b + 1:3 * b + 1][:n] += add.to(torch.int32)
    pos = d64[t:2 * t].view(b, q)[:n, :m]
    pos += add[:, None]
    ids = torch.cat([root, drafts.drafts(pos[:, 1:], shape)], dim=1)  # [n, m]
    d64[0:t].view(b, q)[:n, :m] = ids
    at = ctx.to(torch.int64)[:, None] + ar  # [n, m] the rows' KV indices
    tables = d32[3 * b + 1:3 * b + 1 + b * w].view(b, w)[:n]
    blocks = tables.gather(1, at // block_size).to(torch.int64)
    slots = blocks * block_size + at % block_size
    d64[2 * t:3 * t].view(b, q)[:n, :m] = slots
    return ids, slots


def staged_segments(segs: list[Segment], block_size: int, shape: TreeShape,
                    emitted: torch.Tensor, num: torch.Tensor, rows: list[int], drafts
                    ) -> tuple[torch.Tensor, torch.Tensor, list[Segment]]:
    """For a runner without graphs (the CPU): the step staged in a graph bucket's layout and
    moved on by `advance_staged`, as on the GPU, then read out as segments. Returns (input
    tokens [n, m], KV slots [n, m], the segments)."""
    n, m = len(segs), shape.rows
    width = max(len(g.block_table) for g in segs)
    lay = Layout(next((x for x in BATCH_SIZES if x >= n), n),
                 next((x for x in TOKENS_PER_SEQ if x >= m), m), width)
    h64, h32 = np.zeros(lay.n64, np.int64), np.zeros(lay.n32, np.int32)
    pack_step(segs, lay, h64, h32, np.zeros(max(1, lay.nmask), bool))
    d64, d32 = torch.from_numpy(h64), torch.from_numpy(h32)
    ids, slots = advance_staged(d64, d32, lay, block_size, n, shape, emitted, num,
                                torch.tensor(rows, dtype=torch.long), drafts)
    pos = d64[lay.tokens:2 * lay.tokens].view(lay.batch, lay.q)[:n, :m].tolist()
    ctx = d32[lay.batch + 1:lay.batch + 1 + n].tolist()
    out = [Segment(t, p, sl, c, g.block_table, mask=g.mask, logits_rows=g.logits_rows)
           for t, p, sl, c, g in zip(ids.tolist(), pos, slots.tolist(), ctx, segs)]
    return ids, slots, out
