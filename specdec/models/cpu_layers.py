"""A quantized model's decoder layers run by one C call per step (specdec/cpu_kernels/
layer_step.c) instead of ~30 PyTorch ops a layer.

`CpuLayers.of(model)` describes every layer's weights to the C side once (pointers into the
QuantLinear parts, which never move); `forward` then fills one step record (row count, rotary
factors, KV slots, what each row attends to, scratch buffers) and runs the layers. Embedding,
the final norm and the output layer stay in PyTorch: one op each per step.

The arithmetic is the module path's (llama.py's DecoderLayer on QuantLinear weights), with its
own float rounding in norms, rotary and silu; speculative and plain decoding both run it, and
every op treats each row on its own, so greedy speculative output still equals plain greedy.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from specdec.attention_metadata import AttentionMetadata
from specdec.cpu_kernels.attention import RowsView
from specdec.models.quant_linear import BITS, QuantLinear

MAX_PARTS = 3
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("kind", I64), ("n", I64), ("rows", I64), ("qs", P), ("d", P), ("mn", P)]


class _Linear(ctypes.Structure):
    _fields_ = [("nparts", I64), ("k", I64), ("width", I64), ("parts", _Part * MAX_PARTS),
                ("bias", P)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", P), ("post_norm", P), ("q_norm", P), ("k_norm", P),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("kc", P), ("vc", P)]


class _Step(ctypes.Structure):
    _fields_ = [("M", I64), ("H", I64), ("Hq", I64), ("Hkv", I64), ("D", I64), ("rot", I64),
                ("inter", I64), ("eps", F32), ("scale", F32), ("path", I64),
                ("cos", P), ("sin", P), ("slots", P), ("block_tables", P),
                ("bt_stride", I64), ("block_size", I64), ("row_seq", P), ("row_prefix", P),
                ("extra_ptr", P), ("extra_slots", P),
                ("x", P), ("wide", P), ("attn", P), ("narrow", P), ("xq", P), ("xd", P),
                ("xs", P)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(m: Any) -> _Linear | None:
    if not isinstance(m, QuantLinear) or len(m.parts) > MAX_PARTS:
        return None
    out = _Linear(len(m.parts), m.in_features, m.width)
    for i, p in enumerate(m.parts):
        out.parts[i] = _Part(BITS[p.kind], p.n, p.rows, p.qs.data_ptr(),
                             p.d.data_ptr(), _ptr(p.mn))
    out.bias = _ptr(m.bias)
    return out


class CpuLayers:
    """The C run of a LlamaForCausalLM's decoder layers; `of` says None where it cannot."""

    def __init__(self, model: Any, layers: list[_Layer], path: str) -> None:
        m = model.model
        a0 = m.layers[0].self_attn
        self.model = model
        self.layers = (_Layer * len(layers))(*layers)
        self.path = path
        self.hidden = m.norm.weight.numel()
        self.hq, self.hkv, self.d = a0.num_heads, a0.num_kv_heads, a0.head_dim
        self.inter = m.layers[0].mlp.inter
        self.eps = float(m.layers[0].input_layernorm.eps)
        self.scale = float(a0.scale)
        self.widths = tuple(max(getattr(lay, f).width for lay in layers)
                            for f in ("qkv", "gate_up", "o", "down"))
        self._scratch: tuple[int, list[torch.Tensor]] | None = None
        self._kv_bound: int | None = None

    @staticmethod
    def of(model: Any, path: str = "auto") -> CpuLayers | None:
        """None where a layer is not all QuantLinear, or the shapes are outside the C code's
        (head_dim % 16, Hq / Hkv <= 16, rotary over at most 512 dims)."""
        m = model.model
        a0 = m.layers[0].self_attn
        if a0.head_dim % 16 or a0.num_heads % a0.num_kv_heads or a0.group > 16 \
                or m.rotary.rot_dim > 512 or m.rotary.rot_dim % 2:
            return None
        recs: list[_Layer] = []
        for lay in m.layers:
            at, mlp = lay.self_attn, lay.mlp
            lins = [_linear(at.qkv_proj), _linear(at.o_proj), _linear(mlp.gate_up_proj),
                    _linear(mlp.down_proj)]
            if any(x is None for x in lins) or len(at.qkv_proj.parts) != 3 \
                    or len(mlp.gate_up_proj.parts) != 2:
                return None
            norms = [lay.input_layernorm, lay.post_attention_layernorm, at.q_norm, at.k_norm]
            if any(n is not None and (n.weight.dtype != torch.float32
                                      or not n.weight.is_contiguous()) for n in norms):
                return None
            qn = None if at.q_norm is None else at.q_norm.weight.data_ptr()
            kn = None if at.k_norm is None else at.k_norm.weight.data_ptr()
            recs.append(_Layer(lay.input_layernorm.weight.data_ptr(),
                               lay.post_attention_layernorm.weight.data_ptr(), qn, kn, *lins))
        from specdec.cpu_kernels.build import KernelUnavailable, choose_path, library

        try:
            library(choose_path(1) if path == "auto" else path)
        except KernelUnavailable:
            return None
        return CpuLayers(model, recs, path)

    def _buffers(self, rows: int) -> list[torch.Tensor]:
        if self._scratch is None or self._scratch[0] < rows:
            qd = self.hq * self.d
            kmax = max(self.hidden, qd, self.inter)
            wide, narrow = max(self.widths[:2]), max(self.widths[2:])
            self._scratch = (rows, [
                torch.empty(rows, kmax), torch.empty(rows, wide), torch.empty(rows, qd),
                torch.empty(rows, narrow), torch.empty(rows, kmax, dtype=torch.int8),
                torch.empty(rows, kmax // 32), torch.empty(rows, kmax // 32)])
        return self._scratch[1]

    def _bind_kv(self, kv: torch.Tensor) -> None:  # kv [L, 2, blocks, block_size, Hkv, D]
        if self._kv_bound == kv.data_ptr():
            return
        assert kv.dtype == torch.float32 and kv.is_contiguous()
        for i in range(len(self.layers)):
            self.layers[i].kc, self.layers[i].vc = kv[i, 0].data_ptr(), kv[i, 1].data_ptr()
        self._kv_bound = kv.data_ptr()

    def run(self, res: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv: torch.Tensor, rows: RowsView, layers: range) -> None:
        """Layers `layers` over the residual stream res [T, hidden] float32, in place."""
        from specdec.cpu_kernels.build import PATHS, choose_path, library

        t = res.shape[0]
        self._bind_kv(kv)
        cos, sin = self.model.model.rotary.cos_sin(positions, torch.float32)  # [T, 1, rot]
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        path = choose_path(t) if self.path == "auto" else self.path
        bufs = self._buffers(t)
        tables = meta.block_tables.to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = _Step(t, self.hidden, self.hq, self.hkv, self.d, cos.shape[1], self.inter,
                     self.eps, self.scale, PATHS[path], cos.data_ptr(), sin.data_ptr(),
                     slots.data_ptr(), tables.data_ptr(), tables.shape[1], kv.shape[3],
                     rows.row_seq.data_ptr(), rows.row_prefix.data_ptr(),
                     rows.extra_ptr.data_ptr(), rows.extra_slots.data_ptr(),
                     *(b.data_ptr() for b in bufs))
        first = ctypes.byref(self.layers, layers.start * ctypes.sizeof(_Layer))
        rc = library(path).sd_layers(first, len(layers), res.data_ptr(), ctypes.byref(step))
        if rc != 0:
            raise RuntimeError("sd_layers refused the step's shapes")
