"""Runs a model over a step's flattened batch: owns the weights, the KV cache and the backend.

A step arrives as `Segment`s (specdec/step_inputs.py, which also turns them into device
tensors); `execute` runs them eagerly or through a CUDA graph bucket.
"""

from __future__ import annotations

import math
import mmap

import torch

from specdec.attention import TorchAttentionBackend
from specdec.config import CacheConfig, ModelConfig, RuntimeConfig
from specdec.models import build_model
from specdec.sampler import host_to_device
from specdec.step_inputs import Segment, StepOutput, eager_inputs


def kv_bytes_per_block(mc: ModelConfig, block_size: int) -> int:
    elem = torch.tensor([], dtype=mc.torch_dtype).element_size()
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * mc.head_dim * elem


def get_attention_backend(name: str, device: torch.device, cpu_kernel: str = "auto"):
    """'auto' picks Triton on CUDA and the row kernel on the CPU (specdec/cpu_kernels)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        from specdec.cpu_kernels.attention import CpuAttentionBackend

        return CpuAttentionBackend(TorchAttentionBackend(), cpu_kernel)
    if name == "triton":
        from verify_kernels.backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}: choose 'cpu', 'torch', 'triton' "
                     "or 'auto'")


def _kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed KV cache. On the CPU its pages come from an anonymous mapping (returned too),
    which the OS zero-fills on first touch, so memory is committed as blocks are used, not all
    at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=dtype).view(shape), buf


class ModelRunner:
    def __init__(self, mc: ModelConfig, cc: CacheConfig, attention_backend: str = "auto",
                 runtime: RuntimeConfig | None = None):
        runtime = runtime or RuntimeConfig()
        self.mc = mc
        self.device = torch.device(mc.device)
        self.dtype = mc.torch_dtype
        self.model = build_model(mc.hf_config, mc.path, self.dtype, self.device, mc.load_format,
                                 mc.quantization, mc.cpu_kernel, runtime.pdl,
                                 runtime.skinny_tune)
        self.block_size = cc.block_size
        self.num_blocks = cc.num_blocks or self._budget_blocks(mc, cc)
        # On the CPU, the blocks cached prefixes may keep written (BlockManager.resident): the
        # pool's pages are committed as its blocks are first written. CUDA's is allocated whole.
        self.resident_blocks = (None if self.device.type == "cuda" else max(
            1, cc.cpu_kv_resident_bytes // kv_bytes_per_block(mc, cc.block_size)))
        self.kv, self._kv_map = _kv_cache((mc.num_layers, 2, self.num_blocks, cc.block_size,
                                           mc.num_kv_heads, mc.head_dim), self.dtype,
                                          self.device)
        self.backend = get_attention_backend(attention_backend, self.device, mc.cpu_kernel)
        self.vocab_size = mc.vocab_size
        # --- CUDA graphs: CUDA with the Triton backend only; None keeps every step eager. ---
        self.graphs = None
        if (runtime.cuda_graphs and self.device.type == "cuda"
                and getattr(self.backend, "name", "") == "triton"):
            from specdec.cuda_graphs import GraphRunner

            width = -(-int(mc.max_model_len or 4096) // cc.block_size)
            self.graphs = GraphRunner(self.model, self.kv, self.backend, cc.block_size, width,
                                      self.device, runtime)
        # --- end CUDA graphs ---
        if self.device.type == "cuda":
            # Compiles the compaction kernel now, not inside the first step that accepts a
            # side branch of a tree (a slot onto itself changes nothing).
            self.move_kv([0], [0])

    def release_kv_pages(self) -> bool:
        """On the CPU, hand every written page of the KV pool back to the OS, its contents
        zeros again; for a pool no block holds anything in (the caller's to know). The
        step-cost calibration writes timed sequences across the pool: on a fresh start of the
        default server, 338 MB of the target's and the draft model's pools."""
        if self._kv_map is None or not hasattr(mmap, "MADV_REMOVE"):
            return False
        self._kv_map.madvise(mmap.MADV_REMOVE)
        return True

    def _budget_blocks(self, mc: ModelConfig, cc: CacheConfig) -> int:
        per_block = kv_bytes_per_block(mc, cc.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            budget = cc.cpu_kv_bytes
        return max(1, budget // per_block)

    @torch.inference_mode()
    def execute(self, segments: list[Segment], capture_layers: tuple[int, ...] | None = None,
                token_source: torch.Tensor | None = None, fixup=None) -> StepOutput:
        """`token_source`: [len(segments)] device tokens that replace the tokens of one-row
        segments (the previous step's tokens, not yet on the host: specdec.chaining).
        `fixup(d64, d32, layout)`: edits a graph step's staged device inputs in place before
        the replay (specdec.chaining); such a step must fit a graph bucket."""
        if self.graphs is not None and capture_layers is None:  # CUDA graphs (see __init__)
            out = self.graphs.execute(segments, token_source, fixup)
            if out is not None:
                return out
        if fixup is not None:
            raise RuntimeError("a step with device-side inputs must run through a CUDA graph")
        input_ids, positions, meta = eager_inputs(segments, self.device, self.block_size)
        if token_source is not None:
            assert input_ids.shape == token_source.shape, "token_source needs one-row segments"
            input_ids.copy_(token_source)
        hidden, captured = self.model(input_ids, positions, meta, self.kv, self.backend,
                                      capture_layers or ())
        features = None if capture_layers is None else torch.cat(captured + [hidden], dim=-1)
        rows: list[int] = []
        offsets: list[int] = []
        start = 0
        for s in segments:
            offsets.append(len(rows))
            rows += [start + r for r in s.logits_rows]
            start += len(s.tokens)
        h = hidden  # every query row has logits (decodes, trees): no gather
        if rows != list(range(start)):
            h = hidden.index_select(0, host_to_device(rows, torch.long, self.device))
        qoff = [0]
        for s in segments[:-1]:
            qoff.append(qoff[-1] + len(s.tokens))
        return StepOutput(self.model.compute_logits(h), offsets, features, qoff)

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """`move_kv_device` of host slot lists, after one non-blocking copy of them (the host
        never waits for the device here)."""
        if not src_slots:
            return
        # dst starts at an even index: 16-byte aligned like src, so every call meets the one
        # kernel variant Triton compiled (it specialises pointers on alignment).
        m, at = len(src_slots), len(src_slots) + len(src_slots) % 2
        pairs = host_to_device(src_slots + [0] * (at - m) + dst_slots, torch.long, self.device)
        self.move_kv_device(pairs[:m], pairs[at:])

    @torch.inference_mode()
    def move_kv_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV entries of all layers from src to dst slots (accepted tree paths), each
        sequence's pairs in ascending dst order with src >= dst (its accepted nodes move down
        to consecutive positions; a pair may be a slot onto itself: nothing moves). On CUDA one
        launch (verify_kernels.kv_ops.compact_kv)."""
        if self.device.type == "cuda":
            from verify_kernels.kv_ops import compact_kv

            compact_kv(self.kv, src, dst, sorted_by_dst=True)
        else:
            flat = self.kv.view(self.kv.shape[0], 2, -1, *self.kv.shape[4:])
            flat[:, :, dst] = flat[:, :, src]  # the gather copies before the write
