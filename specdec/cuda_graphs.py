"""CUDA graphs of the target's forward pass for decode and verification steps.

A step qualifies when its segments fit a bucket (B sequences, Q query rows each): every segment
is padded to Q rows and the batch to B sequences, so one captured graph serves every step of
that shape. Graph inputs live in a static device buffer that is filled, once per step, by one
non-blocking copy from a pinned host buffer; the attention kernel reads the step's metadata
from device memory, so with its grid and split count fixed per bucket a replay is exact. With
one row per sequence, or at most LOGITS_IN_GRAPH_TOKENS rows in all (verification steps of
one or a few sequences), the LM head is in the graph too (its logits are valid until the next
replay): no gather of the rows that need logits and no launch of the LM head after the replay,
and its tiles are tuned in the whole step like the other matmuls'.

Padding, and why it is harmless:
- a padded row has slot -1 (the KV write skips it), position 0 and token 0;
- with Q > 1 every sequence uses an explicit [Q, Q] mask: a real row sees only real rows (its
  tree ancestors, or earlier rows for a causal segment); a padded row sees only itself;
- a padded sequence has context 0 and a block table of zeros: it computes garbage that no one
  reads. KV entries past a sequence's rows are masked, and every cache entry is finite.

Steps outside the buckets (long prefill chunks, more sequences than the largest bucket, steps
that capture hidden layers) run eagerly: `execute` returns None for them.

On a bucket's first capture its KV split count and matmul tiles are timed in the whole captured
step, on a placeholder step at a fixed context (`specdec/graph_tuning.py`), and kept on disk
for the next runner of the same model, GPU and code. `capture_all` does every bucket up front,
so that no step waits for a capture (the server calls it at start).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from specdec.attention import AttentionMetadata
from specdec.graph_tuning import (
    Outputs,
    cache_file,
    heuristic_splits,
    load_choices,
    save_choices,
    tune_splits,
    tune_tiles,
    tuning_segments,
)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
TOKENS_PER_SEQ = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPH_TOKENS = 2048
# Buckets of up to this many rows (the few-row matmul's limit) compute every row's logits in
# the graph; the LM head reads its weight once whatever the rows.
LOGITS_IN_GRAPH_TOKENS = 16


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


class _Staging(NamedTuple):
    """A bucket's views of the staging buffers (`GraphRunner._staging`)."""

    h64: np.ndarray  # the pinned buffer's int64, int32 and mask parts, as numpy arrays
    h32: np.ndarray
    hmask: np.ndarray
    d64: torch.Tensor  # the device buffer's int64 part
    src: torch.Tensor  # the pinned and device bytes the step's copy moves
    dst: torch.Tensor


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
    tables_written: list[list[int]] | None = None,
) -> tuple[int, list[int], bool]:
    """Write a step's padded inputs in `lay`'s layout; return (logits rows, row offsets, whether
    those rows are the bucket's first rows in order).

    `tables_written`: the block-table rows this buffer holds from the last call with the same
    layout (B lists, updated here): rows that did not change are not written again (a block
    table grows by one block every block_size tokens; 16 rows of 60-odd blocks cost a third of
    this function). None writes every row."""
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
    if tables_written is None:
        tables[:] = 0
        for i, s in enumerate(segments):
            tables[i, :len(s.block_table)] = s.block_table
    else:
        for i in range(b):
            table = segments[i].block_table if i < len(segments) else []
            old = tables_written[i]
            if table != old:
                tables[i, :len(table)] = table
                tables[i, len(table):len(old)] = 0
                tables_written[i] = list(table)
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


class _FixedSplits:
    """The Triton backend with the split-KV count fixed, so a captured launch stays valid."""

    name = "triton-graph"

    def __init__(self, inner: Any, splits: int) -> None:
        self.inner, self.splits = inner, splits

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.inner.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from verify_kernels.paged_attention import paged_attention

        return paged_attention(q, k_cache, v_cache, meta, scale, num_splits=self.splits)

    def fuses(self, meta: AttentionMetadata, group: int = 1) -> bool:
        return self.inner.fuses(meta, group) if hasattr(self.inner, "fuses") else False

    def step_rope(self, meta: AttentionMetadata, positions, inv_freq, rope_scaling,
                  group: int = 1):
        if not hasattr(self.inner, "step_rope"):
            return None
        return self.inner.step_rope(meta, positions, inv_freq, rope_scaling, group)

    def decode(self, q, k, v, positions, inv_freq, rope_scaling, k_cache, v_cache,
               meta: AttentionMetadata, scale: float, rope=None) -> torch.Tensor:
        return self.inner.decode(q, k, v, positions, inv_freq, rope_scaling, k_cache, v_cache,
                                 meta, scale, num_splits=self.splits, rope=rope)


class GraphRunner:
    """Captures (lazily, on a bucket's first step) and replays the model's forward pass."""

    def __init__(self, model: Any, kv: torch.Tensor, backend: Any, block_size: int,
                 width: int, device: torch.device) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.block_size, self.width, self.device = block_size, width, device
        attn = model.model.layers[0].self_attn
        self.hq, self.hkv = attn.num_heads, attn.num_kv_heads
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        mb, mt, mq = max(BATCH_SIZES), MAX_GRAPH_TOKENS, max(TOKENS_PER_SEQ)
        most = 8 * (4 * mt + mb) + 4 * (3 * mb + 1 + mb * width) + mt * mq  # >= any nbytes
        self.hbuf = torch.zeros(most, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dbuf = torch.zeros(most, dtype=torch.uint8, device=device)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._staged: dict[Layout, _Staging] = {}  # per bucket, made once
        # The layout the pinned buffer was last packed in, and its block-table rows (pack_step).
        self._tables: tuple[Layout | None, list[list[int]]] = (None, [])
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.replays = 0
        self.eager_steps = 0
        self.tune = os.environ.get("SPECDEC_TUNE_GRAPHS", "1") != "0"
        self.tuned: dict[tuple[int, int], dict] = {}  # per bucket: step ms before/after, trials
        self.tuned_keys: set[tuple] = set()  # matmul keys whose tiles were tuned in a graph
        self.splits: dict[tuple[int, int], int] = {}  # per bucket: split count chosen by timing
        # Choices an earlier runner of the same model, GPU and code kept on disk: those buckets
        # are captured without timing (graph_tuning.cache_file).
        self.cache = cache_file(self) if self.tune else None
        self.loaded: set[tuple[int, int]] = set()
        if self.cache is not None and self.cache.exists():
            self.loaded = load_choices(self, self.cache)
            for key in self.loaded:
                self.tuned[key] = {"loaded": str(self.cache)}

    def num_splits(self, b: int, q: int) -> int:
        """Split-KV partitions for a bucket: the count timed best at its capture, else the
        heuristic's (graph_tuning.heuristic_splits)."""
        if (b, q) in self.splits:
            return self.splits[(b, q)]
        return heuristic_splits(b, q, self.hq, self.hkv, self.sms, self.width * self.block_size)

    def owner_split(self, b: int, q: int) -> bool:
        """Whether the bucket's attention kernel keeps split 0 for the step's own columns (the
        fused tree kernel: verify_kernels/tree_attention.py)."""
        from verify_kernels import tree_attention as tree

        return (getattr(self.backend, "fused_tree", False) and b <= tree.MAX_SEQS
                and 2 <= q <= tree.MAX_Q
                and q * tree._next_pow2(self.hq // self.hkv) <= tree.MAX_PROGRAM_ROWS)

    def execute(self, segments: list[Any], token_source: torch.Tensor | None = None):
        """The step's StepOutput through a graph, or None when the step must run eagerly.
        `token_source`: see ModelRunner.execute."""
        from specdec.model_runner import StepOutput

        key = pick_bucket(segments, self.width, self.block_size)
        if key is None:
            self.eager_steps += 1
            return None
        lay = Layout(key[0], key[1], self.width)
        if key not in self.graphs:
            self._capture(lay)
        n_rows, offsets, leading = self._stage(segments, lay)
        d64 = self._staging(lay).d64
        if token_source is not None:
            assert lay.q == 1, "token_source needs one-row segments"
            d64[:len(segments)].copy_(token_source)  # after the staged ids, same stream
        graph, (hidden, logits) = self.graphs[key]
        graph.replay()
        self.replays += 1
        if logits is not None and leading:  # the rows with logits come first, in order
            # Views of graph memory: their readers are queued before the next step's replay.
            return StepOutput(logits[:n_rows], hidden[:n_rows], offsets)
        idx = d64[lay.rows_at:lay.rows_at + n_rows]
        h = hidden.index_select(0, idx)  # [rows, hidden], outside the graph's memory
        if logits is not None:
            return StepOutput(logits.index_select(0, idx), h, offsets)
        return StepOutput(self.model.compute_logits(h), h, offsets)

    @torch.inference_mode()
    def capture_all(self, max_batch: int, max_q: int) -> int:
        """Capture every bucket up to `max_batch` sequences of `max_q` rows (tuned on the
        way). Returns how many were captured."""
        n = 0
        for b in (x for x in BATCH_SIZES if x <= max_batch):
            for q in (x for x in TOKENS_PER_SEQ if x <= max_q and b * x <= MAX_GRAPH_TOKENS):
                if (b, q) not in self.graphs:
                    self._capture(Layout(b, q, self.width))
                    n += 1
        torch.cuda.synchronize(self.device)
        return n

    def _stage(self, segments: list[Any], lay: Layout) -> tuple[int, list[int], bool]:
        """Pack `segments` into the pinned buffer and queue its one copy to the device."""
        self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        v = self._staging(lay)
        if self._tables[0] != lay:  # layouts share the buffer: another one wrote over it
            v.h32[3 * lay.batch + 1:lay.n32] = 0
            self._tables = (lay, [[] for _ in range(lay.batch)])
        packed = pack_step(segments, lay, v.h64, v.h32, v.hmask, self._tables[1])
        v.dst.copy_(v.src, non_blocking=True)
        self._copied.record()
        return packed

    def _staging(self, lay: Layout) -> _Staging:
        """The bucket's views of the staging buffers, made once: a step's host work before its
        replay is time the GPU waits, at every step of a speculative batch."""
        v = self._staged.get(lay)
        if v is None:
            h64, h32, hmask = self._views(self.hbuf, lay)
            v = self._staged[lay] = _Staging(
                h64.numpy(), h32.numpy(), hmask.numpy(), self._views(self.dbuf, lay)[0],
                self.hbuf[:lay.nbytes], self.dbuf[:lay.nbytes])
        return v

    @staticmethod
    def _views(buf: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(int64, int32, mask) parts of a staging buffer in `lay`'s layout."""
        return (buf[:lay.at32].view(torch.int64), buf[lay.at32:lay.at_mask].view(torch.int32),
                buf[lay.at_mask:lay.nbytes].view(torch.bool))

    def forward(self, lay: Layout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([T, hidden], and [T, V] logits with one row per sequence or at most
        LOGITS_IN_GRAPH_TOKENS rows: there the LM head joins the graph), on the staged inputs."""
        ids, pos, meta = padded_metadata(lay, *self._views(self.dbuf, lay), self.block_size)
        backend = _FixedSplits(self.backend, self.num_splits(lay.batch, lay.q))
        hidden, _ = self.model(ids, pos, meta, self.kv, backend)
        in_graph = lay.q == 1 or lay.tokens <= LOGITS_IN_GRAPH_TOKENS
        return hidden, self.model.compute_logits(hidden) if in_graph else None

    def capture(self, lay: Layout) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """A graph of `forward` with the current split count and tiles."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = self.forward(lay)
        return graph, outs

    def _capture(self, lay: Layout) -> None:
        """The bucket's graph, captured and tuned on a placeholder step that writes no KV
        (graph_tuning.tuning_segments); the caller stages its own step afterwards."""
        from verify_kernels import skinny_tiles

        segs = tuning_segments(lay.batch, lay.q, self.width, self.block_size, self.kv.shape[2])
        self._stage(segs, lay)
        with skinny_tiles.recording_keys() as keys:
            self.forward(lay)  # compiles the kernels (and times new matmul shapes alone)
        keys = [k for k in keys if k not in self.tuned_keys]
        graph, outs = self.capture(lay)
        tune = self.tune and (lay.batch, lay.q) not in self.loaded
        if tune:
            self.tuned.setdefault((lay.batch, lay.q), {})["context"] = segs[0].context_len
            graph, outs = tune_splits(self, lay, graph, outs)
        if tune and keys:
            graph, outs = tune_tiles(self, lay, keys, graph, outs)
        self.graphs[(lay.batch, lay.q)] = (graph, outs)
        if tune and self.cache is not None:
            try:
                save_choices(self, self.cache)
            except OSError:  # a read-only cache: the next start tunes again
                self.cache = None
