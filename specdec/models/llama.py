"""The Llama family as plain modules: Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5 (qkv bias) and
Qwen3 (per-head q/k RMSNorm). One implementation with architecture flags, built from an HF
`config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention_metadata import AttentionMetadata
from specdec.models.cpu_linear import cpu_linear
from specdec.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from verify_kernels.skinny_gemm import ScaledRows
    from verify_kernels.skinny_tiles import TileChoices


# From this many rows (up to the few-row matmul's 16) the fused path's embedding lookup leaves
# the first norm's input for the first qkv matmul (verify_kernels/fused_ops.embed_scaled);
# below, that matmul folds the norm into its loop. On the H200 (Llama-3.1-8B shape, batch 1,
# steps timed alternately in one process) the hand-off made the 8-row step 5-10 us faster and
# the 1-row step 8-13 us slower (bench/results/gpu_ab_h200_20261201.json).
EMBED_HANDOFF_MIN_ROWS = 2


@dataclass(frozen=True)
class FusedKernels:
    """What the fused path hands its kernels (verify_kernels), made from the engine's
    RuntimeConfig by the loader: the few-row matmul's tile choices (timed on first use,
    re-timed inside whole steps by the CUDA graph runner) and programmatic dependent launch."""

    tiles: TileChoices
    pdl: bool = False


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool
    qk_norm: bool


ARCHITECTURES: dict[str, ArchFlags] = {
    "LlamaForCausalLM": ArchFlags(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": ArchFlags(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": ArchFlags(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": ArchFlags(qkv_bias=False, qk_norm=True),
}


class Linear(nn.Linear):
    """nn.Linear, except on the CPU (float32, bfloat16) at few rows, where the fastest of
    several kernels is picked per shape (see cpu_linear.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return cpu_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalised in float32, rounded, then scaled in the model dtype (as HF checkpoints do).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hf: dict[str, Any], flags: ArchFlags, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = int(hf["num_attention_heads"])
        self.num_kv_heads = int(hf.get("num_key_value_heads") or self.num_heads)
        self.group = self.num_heads // self.num_kv_heads  # query heads per KV head
        self.head_dim = int(hf.get("head_dim") or hf["hidden_size"] // self.num_heads)
        hidden = int(hf["hidden_size"])
        bias = flags.qkv_bias or bool(hf.get("attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one weight read, one launch.
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=bool(hf.get("attention_bias", False)))
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if flags.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        backend: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_norm is None:  # q and k side by side in qkv: rotate both at once
            qk = RotaryEmbedding.apply(qkv[:, :self.q_size + self.kv_size].view(t, hq + hkv, d),
                                       *cos_sin)  # [T, Hq + Hkv, D]
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q, k = RotaryEmbedding.apply(q, *cos_sin), RotaryEmbedding.apply(k, *cos_sin)
        backend.write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        o = backend.attend(q, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))

    def forward_fused(
        self,
        res: torch.Tensor,  # [T, hidden] residual stream, o_proj's output is added in place
        norm: RMSNorm,  # the layer's input norm, folded into the qkv matmul
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        backend: Any,
        prenormed: ScaledRows | None,  # `norm`'s input as the matmul before left it
        next_norm: RMSNorm,  # the norm after the residual add, whose input o_proj may leave
        kernels: FusedKernels,
        rope: torch.Tensor | None = None,  # the step's rotary factors (backend.step_rope)
    ) -> ScaledRows | None:
        from verify_kernels.fused_ops import rope_write_kv
        from verify_kernels.skinny_gemm import fused_linear, residual_linear

        t = res.shape[0]
        tiles, pdl = kernels.tiles, kernels.pdl
        qkv = fused_linear(res, self.qkv_proj.weight, self.qkv_proj.bias, norm_weight=norm.weight,
                           eps=norm.eps, prenormed=prenormed, tiles=tiles,
                           pdl=pdl)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv, rs = self.rotary.inv_freq, self.rotary.attention_scaling
        if hasattr(backend, "fuses") and backend.fuses(meta, self.group):  # rotary, KV inside
            o = backend.decode(q, k, v, positions, inv, rs, kv[0], kv[1], meta, self.scale,
                               rope=rope, pdl=pdl)
        else:
            rope_write_kv(q, k, v, positions, inv, rs, kv[0], kv[1], meta.slot_mapping)
            o = backend.attend(q, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        return residual_linear(o.view(t, self.q_size), self.o_proj.weight, self.o_proj.bias,
                               res, next_norm.weight, tiles=tiles, pdl=pdl)


class MLP(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        bias = bool(hf.get("mlp_bias", False))
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict[str, Any], flags: ArchFlags, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(int(hf["hidden_size"]), eps)
        self.self_attn = Attention(hf, flags, rotary)
        self.post_attention_layernorm = RMSNorm(int(hf["hidden_size"]), eps)
        self.mlp = MLP(hf)

    def forward(self, x, residual, cos_sin, positions, meta, kv, backend):
        residual = x if residual is None else x + residual
        h = self.self_attn(self.input_layernorm(residual), cos_sin, positions, meta, kv, backend)
        residual = h + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual

    def forward_fused(self, res, positions, meta, kv, backend, prenormed: ScaledRows | None,
                      next_norm: RMSNorm | None, kernels: FusedKernels,
                      rope: torch.Tensor | None = None) -> ScaledRows | None:
        """The GPU path: `res` [T, hidden] is the residual stream, updated in place; norms and
        the activation ride inside the matmuls (verify_kernels/skinny_gemm.py). Each
        residual-writing matmul may leave the next norm's input (ScaledRows) for the matmul
        that reads it; `prenormed` is this layer's, `next_norm` the next layer's input norm."""
        from verify_kernels.skinny_gemm import fused_linear, residual_linear

        ln, mlp = self.post_attention_layernorm, self.mlp
        mid = self.self_attn.forward_fused(res, self.input_layernorm, positions, meta, kv,
                                           backend, prenormed, ln, kernels, rope)
        act = fused_linear(res, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                           norm_weight=ln.weight, eps=ln.eps, gated=True, prenormed=mid,
                           tiles=kernels.tiles, pdl=kernels.pdl)  # [T, inter]
        return residual_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, res,
                               next_norm.weight if next_norm is not None else None,
                               tiles=kernels.tiles, pdl=kernels.pdl)


class LlamaModel(nn.Module):
    def __init__(self, hf: dict[str, Any], flags: ArchFlags) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(int(hf["vocab_size"]), int(hf["hidden_size"]))
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        self.rotary = RotaryEmbedding(head_dim, hf)
        self.layers = nn.ModuleList(
            DecoderLayer(hf, flags, self.rotary) for _ in range(int(hf["num_hidden_layers"]))
        )
        self.norm = RMSNorm(int(hf["hidden_size"]), float(hf.get("rms_norm_eps", 1e-6)))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, meta, kv_cache, backend) -> final hidden states."""

    def __init__(self, hf: dict[str, Any], flags: ArchFlags) -> None:
        super().__init__()
        self.hf = hf
        self.model = LlamaModel(hf, flags)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        # Fused Triton norms, rotary and activation when set (for CUDA, by the loader); None
        # runs the modules above.
        self.kernels: FusedKernels | None = None
        # The CPU's C run of quantized layers (specdec/models/cpu_layers.py), set by the loader.
        self.cpu_layers: Any = None
        self.lm_head = Linear(int(hf["hidden_size"]), int(hf["vocab_size"]), bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def fused(self) -> bool:
        return self.kernels is not None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        backend: Any,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # ([T, hidden], captured [T, hidden] each)
        """Returns the final normed hidden states and the residual stream after each layer
        index in `capture_layers` (what EAGLE-style drafters consume)."""
        m = self.model
        if self.kernels is not None:
            from verify_kernels.fused_ops import embed_scaled, rms_norm
            from verify_kernels.skinny_gemm import EMIT_MIN_ROWS, MAX_ROWS, ScaledRows

            prenormed = None
            if max(EMBED_HANDOFF_MIN_ROWS, EMIT_MIN_ROWS) <= input_ids.shape[0] <= MAX_ROWS:
                # The residual stream and the first norm's input, handed on as each layer's
                # o_proj and down hand on the next norm's (verify_kernels/skinny_gemm.py).
                res, scaled, sumsq = embed_scaled(input_ids, m.embed_tokens.weight,
                                                  m.layers[0].input_layernorm.weight)
                prenormed = ScaledRows(scaled, sumsq)
            else:
                res = m.embed_tokens(input_ids)  # [T, hidden], the residual stream
            rope = None
            if hasattr(backend, "step_rope"):  # once per step, not per layer
                rope = backend.step_rope(meta, positions, m.rotary.inv_freq,
                                         m.rotary.attention_scaling, m.layers[0].self_attn.group)
            captured: list[torch.Tensor] = []
            for i, layer in enumerate(m.layers):
                nxt = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else None
                prenormed = layer.forward_fused(res, positions, meta, kv_cache[i], backend,
                                                prenormed, nxt, self.kernels, rope)
                if i in capture_layers:
                    captured.append(res.clone())
            return rms_norm(res, m.norm.weight, m.norm.eps), captured
        rows = None
        if self.cpu_layers is not None and kv_cache.dtype == torch.float32 \
                and hasattr(backend, "rows"):
            rows = backend.rows(meta)
        if rows is not None:  # quantized on the CPU: layers in C, split where one is captured
            res = m.embed_tokens(input_ids).float().contiguous()  # [T, hidden]: the residual
            captured = []
            start = 0
            for stop in sorted({i + 1 for i in capture_layers} | {len(m.layers)}):
                self.cpu_layers.run(res, positions, meta, kv_cache, rows, range(start, stop))
                if stop - 1 in capture_layers:
                    captured.append(res.clone())
                start = stop
            return m.norm(res), captured
        x = m.embed_tokens(input_ids)
        cos_sin = m.rotary.cos_sin(positions, x.dtype)
        residual = None
        captured = []
        for i, layer in enumerate(m.layers):
            x, residual = layer(x, residual, cos_sin, positions, meta, kv_cache[i], backend)
            if i in capture_layers:
                captured.append(x + residual)
        return m.norm(x + residual), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, V]
        if self.kernels is not None:
            from verify_kernels.skinny_gemm import fused_linear

            return fused_linear(hidden, self.lm_head.weight, out_dtype=torch.float32,
                                tiles=self.kernels.tiles, pdl=self.kernels.pdl)
        return self.lm_head(hidden).float()
