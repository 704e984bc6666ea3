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
for the next runner of the same model, GPU and code (RuntimeConfig's tune_graphs, tune_context
and tuning_cache). `capture_all` does every bucket up front, so that no step waits for a
capture (the GPU benchmarks call it before they time anything).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from specdec.attention_metadata import AttentionMetadata
from specdec.config import RuntimeConfig
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
from specdec.step_inputs import (
    BATCH_SIZES,
    MAX_GRAPH_TOKENS,
    TOKENS_PER_SEQ,
    Layout,
    StepOutput,
    pack_step,
    padded_metadata,
    pick_bucket,
)

if TYPE_CHECKING:
    from verify_kernels.skinny_tiles import TileChoices

# Buckets of up to this many rows (the few-row matmul's limit) compute every row's logits in
# the graph; the LM head reads its weight once whatever the rows.
LOGITS_IN_GRAPH_TOKENS = 16


class _Staging(NamedTuple):
    """A bucket's views of the staging buffers (`GraphRunner._staging`)."""

    h64: np.ndarray  # the pinned buffer's int64, int32 and mask parts, as numpy arrays
    h32: np.ndarray
    hmask: np.ndarray
    d64: torch.Tensor  # the device buffer's int64 part
    src: torch.Tensor  # the pinned and device bytes the step's copy moves
    dst: torch.Tensor


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
               meta: AttentionMetadata, scale: float, rope=None, pdl: bool = False
               ) -> torch.Tensor:
        return self.inner.decode(q, k, v, positions, inv_freq, rope_scaling, k_cache, v_cache,
                                 meta, scale, num_splits=self.splits, rope=rope, pdl=pdl)


class GraphRunner:
    """Captures (lazily, on a bucket's first step) and replays the model's forward pass.
    `runtime`: whether and on what context buckets are tuned, and whether the choices are
    kept on disk; the model's own matmul tile choices (`model.kernels`) are what it re-times."""

    def __init__(self, model: Any, kv: torch.Tensor, backend: Any, block_size: int,
                 width: int, device: torch.device,
                 runtime: RuntimeConfig = RuntimeConfig()) -> None:
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
        self._tables: tuple[Layout | None, list[list[int] | None]] = (None, [])
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.replays = 0
        self.eager_steps = 0
        self.tune = runtime.tune_graphs
        self.tune_context = runtime.tune_context  # cached tokens of the placeholder step
        self.tuned: dict[tuple[int, int], dict] = {}  # per bucket: step ms before/after, trials
        self.tuned_keys: set[tuple] = set()  # matmul keys whose tiles were tuned in a graph
        self.splits: dict[tuple[int, int], int] = {}  # per bucket: split count chosen by timing
        # Choices an earlier runner of the same model, GPU and code kept on disk: those buckets
        # are captured without timing (graph_tuning.cache_file).
        self.cache = (cache_file(self, self.tune_context)
                      if self.tune and runtime.tuning_cache else None)
        self.loaded: set[tuple[int, int]] = set()
        if self.cache is not None and self.cache.exists():
            self.loaded = load_choices(self, self.cache)
            for key in self.loaded:
                self.tuned[key] = {"loaded": str(self.cache)}

    @property
    def tiles(self) -> TileChoices | None:
        """The model's few-row matmul tile choices (verify_kernels.skinny_tiles.TileChoices),
        or None where the model does not run the fused kernels."""
        kernels = getattr(self.model, "kernels", None)
        return kernels.tiles if kernels is not None else None

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

        return getattr(self.backend, "fused_tree", False) and tree.takes(b, q, self.hq // self.hkv)

    def execute(self, segments: list[Any], token_source: torch.Tensor | None = None,
                fixup=None):
        """The step's StepOutput through a graph, or None when the step must run eagerly.
        `token_source`, `fixup`: see ModelRunner.execute."""
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
        if fixup is not None:
            v = self._views(self.dbuf, lay)
            fixup(v[0], v[1], lay)  # queued after the staging copy, before the replay
        graph, (hidden, logits) = self.graphs[key]
        graph.replay()
        self.replays += 1
        if logits is not None and leading:  # the rows with logits come first, in order
            # Views of graph memory: their readers are queued before the next step's replay.
            return StepOutput(logits[:n_rows], offsets)
        idx = d64[lay.rows_at:lay.rows_at + n_rows]
        if logits is not None:
            return StepOutput(logits.index_select(0, idx), offsets)
        # [rows, hidden], outside the graph's memory
        return StepOutput(self.model.compute_logits(hidden.index_select(0, idx)), offsets)

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
            self._tables = (lay, [None] * lay.batch)
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
        segs = tuning_segments(lay.batch, lay.q, self.width, self.block_size, self.kv.shape[2],
                               self.tune_context)
        self._stage(segs, lay)
        tiles = self.tiles
        with tiles.recording_keys() if tiles is not None else nullcontext([]) as keys:
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
