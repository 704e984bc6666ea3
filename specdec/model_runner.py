"""Runs a model over a step's flattened batch: owns the weights, the KV cache and the backend.

The one place a step's plan becomes device tensors is `build_inputs`: every segment (a prefill
chunk, a decode token, or a root plus its draft tree) contributes query rows, positions, KV slots
and, for trees, an ancestor mask.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from specdec.attention import AttentionMetadata, TorchAttentionBackend
from specdec.config import CacheConfig, ModelConfig
from specdec.models import build_model
from specdec.sampler import host_to_device


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
class StepOutput:
    logits: torch.Tensor  # [sum of logits rows, V] float32
    hidden: torch.Tensor  # [same rows, hidden]
    row_offsets: list[int]  # per segment, where its logits rows start
    # With capture_layers: features of EVERY query row, the captured layers' residual streams
    # then the final normed hidden state, concatenated: [T, (len(capture_layers) + 1) * hidden].
    features: torch.Tensor | None = None
    query_offsets: list[int] | None = None  # per segment, where its query rows start


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


def _kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache. On the CPU its pages come from an anonymous mapping, which the OS
    zero-fills on first touch, so memory is committed as blocks are used, not all at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, mc: ModelConfig, cc: CacheConfig, attention_backend: str = "auto"):
        self.mc = mc
        self.device = torch.device(mc.device)
        self.dtype = mc.torch_dtype
        self.model = build_model(mc.hf_config, mc.path, self.dtype, self.device, mc.load_format,
                                 mc.quantization, mc.cpu_kernel)
        self.block_size = cc.block_size
        self.num_blocks = cc.num_blocks or self._budget_blocks(mc, cc)
        self.kv = _kv_cache((mc.num_layers, 2, self.num_blocks, cc.block_size, mc.num_kv_heads,
                             mc.head_dim), self.dtype, self.device)
        self.backend = get_attention_backend(attention_backend, self.device, mc.cpu_kernel)
        self.vocab_size = mc.vocab_size
        # --- CUDA graphs: CUDA with the Triton backend only; None keeps every step eager. ---
        self.graphs = None
        if self.device.type == "cuda" and getattr(self.backend, "name", "") == "triton":
            from specdec.cuda_graphs import GraphRunner

            width = -(-int(mc.max_model_len or 4096) // cc.block_size)
            self.graphs = GraphRunner(self.model, self.kv, self.backend, cc.block_size, width,
                                      self.device)
        # --- end CUDA graphs ---
        if self.device.type == "cuda":
            # Compiles the compaction kernel now, not inside the first step that accepts a
            # side branch of a tree (a slot onto itself changes nothing).
            self.move_kv([0], [0])

    def _budget_blocks(self, mc: ModelConfig, cc: CacheConfig) -> int:
        per_block = kv_bytes_per_block(mc, cc.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            budget = cc.cpu_kv_bytes
        return max(1, budget // per_block)

    def build_inputs(self, segments: list[Segment]):
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
        dev = self.device
        b, t = len(segments), len(ids)
        width = max((len(s.block_table) for s in segments), default=1) or 1
        q_lens = tuple(len(s.tokens) for s in segments)
        ctx = tuple(s.context_len for s in segments)
        # Two host tensors and two copies, whatever the batch: every field is a view of them.
        i32 = starts + list(ctx) + [c + q for c, q in zip(ctx, q_lens)]
        for s in segments:
            i32 += s.block_table + [0] * (width - len(s.block_table))
        d32 = torch.tensor(i32, dtype=torch.int32).to(dev)  # [3B + 1 + B * W]
        d64 = torch.tensor(ids + pos + slots + mask_offsets, dtype=torch.long).to(dev)  # [3T + B]
        meta = AttentionMetadata(
            query_start=d32[0:b + 1], context_lens=d32[b + 1:2 * b + 1],
            seq_lens=d32[2 * b + 1:3 * b + 1], block_tables=d32[3 * b + 1:].view(b, width),
            slot_mapping=d64[2 * t:3 * t],
            custom_mask=torch.cat(masks).to(dev) if masks else None,
            mask_offsets=d64[3 * t:], q_lens_host=q_lens, context_lens_host=ctx,
            mask_offsets_host=tuple(mask_offsets), block_size=self.block_size,
        )
        return d64[0:t], d64[t:2 * t], meta

    @torch.inference_mode()
    def execute(self, segments: list[Segment], capture_layers: tuple[int, ...] | None = None,
                token_source: torch.Tensor | None = None, fixup=None) -> StepOutput:
        """`token_source`: [len(segments)] device tokens that replace the tokens of one-row
        segments (the previous step's argmax, not yet on the host: specdec.overlap).
        `fixup(d64, d32, layout)`: edits a graph step's staged device inputs in place before
        the replay (specdec.spec_overlap); such a step must fit a graph bucket."""
        if self.graphs is not None and capture_layers is None:  # CUDA graphs (see __init__)
            out = self.graphs.execute(segments, token_source, fixup)
            if out is not None:
                return out
        if fixup is not None:
            raise RuntimeError("a step with device-side inputs must run through a CUDA graph")
        input_ids, positions, meta = self.build_inputs(segments)
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
        return StepOutput(self.model.compute_logits(h), h, offsets, features, qoff)

    @torch.inference_mode()
    def move_kv_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`move_kv` of device slot tensors, in the same order rules (a pair may be a slot onto
        itself: nothing moves)."""
        if self.device.type == "cuda":
            from verify_kernels.kv_ops import compact_kv

            compact_kv(self.kv, src, dst, sorted_by_dst=True)
        else:
            flat = self.kv.view(self.kv.shape[0], 2, -1, *self.kv.shape[4:])
            flat[:, :, dst] = flat[:, :, src].clone()

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy KV entries of all layers from src to dst slots (accepted tree paths), each
        sequence's pairs in ascending dst order with src >= dst (its accepted nodes move down
        to consecutive positions): on CUDA one launch (verify_kernels.kv_ops.compact_kv) after
        one non-blocking copy of the slots, so the host never waits for the device here."""
        if not src_slots:
            return
        # dst starts at an even index: 16-byte aligned like src, so every call meets the one
        # kernel variant Triton compiled (it specialises pointers on alignment).
        m, at = len(src_slots), len(src_slots) + len(src_slots) % 2
        pairs = host_to_device(src_slots + [0] * (at - m) + dst_slots, torch.long, self.device)
        src, dst = pairs[:m], pairs[at:]
        if self.device.type == "cuda":
            from verify_kernels.kv_ops import compact_kv

            compact_kv(self.kv, src, dst, sorted_by_dst=True)
        else:
            flat = self.kv.view(self.kv.shape[0], 2, -1, *self.kv.shape[4:])
            flat[:, :, dst] = flat[:, :, src]
