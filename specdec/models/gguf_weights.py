"""A GGUF file's tensors as this engine's weights: kept quantized, or dequantized to float.

Block types map onto `QuantWeight` (w = d * q + mn per group of 32) as follows:

- Q4_0, Q4_1, Q4_K -> q4: the file's 4-bit values; d and mn per 32 from the block (Q4_K:
  d * sc and -dmin * m).
- Q5_0, Q5_1 -> q5: the file's 5-bit values and scales (Q5_0's offset as mn = -16 d).
- Q8_0 -> q8: the file's 8-bit values and scales.
- anything else (Q6_K, Q5_K, Q2_K, Q3_K, F16, BF16, F32, ...) -> q8: dequantized, then
  requantized symmetric, d = absmax / 127 per 32.

The only rounding the first two rows add is of d and mn to fp16 (Q4_K's d * sc and dmin * m are
exact in float32 and rounded once). `quantization="int8"` keeps every type as q8, `"int4"` every
type as q4 (requantizing 5-8 bit types to 4 bits: lossy), `"none"` dequantizes everything to
float exactly as llama.cpp's own dequantization does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdec.models.quant_linear import GROUP, QuantWeight

QUANTIZATIONS = ("auto", "none", "int4", "int8")

_NAMES = {  # GGUF per-layer name -> HF name (after "model.layers.{i}.")
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    return None


def _f16(raw: np.ndarray) -> np.ndarray:  # [..., 2] uint8 -> [...] float32
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:  # [B, 16] -> [B, 32]: j low, j + 16 high
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:  # [B, 4] uint8 -> [B, 32] bit j of the uint32
    bits = qh.copy().view("<u4")[:, 0]
    return ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _decode_blocks(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """raw [B, block bytes] -> (q [B, 32 * groups] ints, d [B, groups], mn [B, groups] | None)."""
    if qtype == "Q4_0":
        d = _f16(raw[:, 0:2].reshape(-1, 1, 2))
        return _nibbles16(raw[:, 2:18]), d, -8.0 * d
    if qtype == "Q4_1":
        return (_nibbles16(raw[:, 4:20]), _f16(raw[:, 0:2].reshape(-1, 1, 2)),
                _f16(raw[:, 2:4].reshape(-1, 1, 2)))
    if qtype == "Q5_0":
        d = _f16(raw[:, 0:2].reshape(-1, 1, 2))
        return _nibbles16(raw[:, 6:22]) | (_high_bits(raw[:, 2:6]) << 4), d, -16.0 * d
    if qtype == "Q5_1":
        q = _nibbles16(raw[:, 8:24]) | (_high_bits(raw[:, 4:8]) << 4)
        return q, _f16(raw[:, 0:2].reshape(-1, 1, 2)), _f16(raw[:, 2:4].reshape(-1, 1, 2))
    if qtype == "Q8_0":
        return raw[:, 2:34].copy().view(np.int8), _f16(raw[:, 0:2].reshape(-1, 1, 2)), None
    if qtype == "Q4_K":
        d, dmin = _f16(raw[:, 0:2].reshape(-1, 1, 2)), _f16(raw[:, 2:4].reshape(-1, 1, 2))
        s = raw[:, 4:16].astype(np.uint8)
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1)
        m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
        qs = raw[:, 16:144].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)
        return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)
    raise KeyError(qtype)


DIRECT = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "q5", "Q5_1": "q5", "Q8_0": "q8"}


def _requantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """Float [N, K] -> the nearest QuantWeight of `kind` (q8: symmetric; q4: affine min/max)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    if kind == "q8":
        d = (g.abs().amax(-1) / 127.0).to(torch.float16).float()
        q = torch.round(g / torch.where(d > 0, d, 1.0)[..., None]).clamp(-127, 127)
        return QuantWeight.pack("q8", q.view(n, k).to(torch.int16), d, None)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15.0).to(torch.float16).float()
    mn = lo.to(torch.float16).float()
    q = torch.round((g - mn[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).clamp(0, 15)
    return QuantWeight.pack("q4", q.view(n, k).to(torch.int16), d, mn)


def _llama_unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp stores Llama q/k rows interleaved for its rotary; undo it on the rows (any
    # per-row data: values, scales, offsets, float weights alike).
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFTensor:
    """One tensor of a GGUF file, read lazily from the memory-mapped file."""

    def __init__(self, t: Any) -> None:
        self.name = t.name
        self.ggml_type = t.tensor_type  # gguf.GGMLQuantizationType
        self.qtype = t.tensor_type.name
        self.shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # [N, K] / [K]
        self._t = t

    def rows_of(self, path: Path) -> np.ndarray:
        """The tensor's raw rows [N, row bytes], mapped from `path` on their own (not through the
        reader's mapping of the whole file, whose pages a load touched)."""
        t = self._t
        raw = np.memmap(path, np.uint8, "r", offset=int(t.data_offset), shape=(int(t.n_bytes),))
        return raw.reshape(self.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        from gguf.quants import dequantize

        arr = dequantize(np.array(self._t.data), self._t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(self.shape)

    def converted(self, quantization: str) -> torch.Tensor | QuantWeight:
        """A QuantWeight where the tensor can stay quantized (2-D, rows a multiple of 32 long,
        quantization not "none"), float32 otherwise."""
        keep = quantization != "none" and len(self.shape) == 2 and self.shape[1] % GROUP == 0
        return self.quantized(quantization) if keep else self.dequantize()

    def quantized(self, quantization: str) -> QuantWeight:
        """The tensor as a QuantWeight, converted a slice of rows at a time (a 150k-row output
        layer would otherwise need several GB of temporaries)."""
        if len(self.shape) != 2 or self.shape[1] % GROUP:
            raise ValueError(f"{self.name}: shape {self.shape} cannot be kept quantized")
        n, k = self.shape
        kind = {"int4": "q4", "int8": "q8"}.get(quantization, DIRECT.get(self.qtype, "q8"))
        raw = np.asarray(self._t.data).reshape(n, -1)  # [N, row bytes], memory-mapped
        parts = [self._rows(raw[r:r + _ROWS], kind) for r in range(0, n, _ROWS)]
        if len(parts) == 1:
            return parts[0]
        cat = torch.cat
        mn = None if parts[0].mn is None else cat([p.mn for p in parts])
        return QuantWeight(kind, cat([p.qs for p in parts]), cat([p.d for p in parts]), mn,
                           sum(p.n for p in parts), k, n)

    def _rows(self, raw: np.ndarray, kind: str) -> QuantWeight:
        from gguf.quants import dequantize

        n, k = raw.shape[0], self.shape[1]
        direct = DIRECT.get(self.qtype)
        if direct is not None and (direct == kind or kind == "q8"):  # 4-5 bit values fit q8
            blocks = raw.reshape(n * (k // (256 if self.qtype == "Q4_K" else GROUP)), -1)
            q, d, mn = _decode_blocks(self.qtype, np.array(blocks))
            return QuantWeight.pack(
                kind, torch.from_numpy(q.astype(np.int16)).view(n, k),
                torch.from_numpy(d).reshape(n, k // GROUP),
                None if mn is None else torch.from_numpy(mn).reshape(n, k // GROUP))
        w = dequantize(np.array(raw), self._t.tensor_type).astype(np.float32, copy=False)
        return _requantize(torch.from_numpy(w).view(n, k), kind)


_ROWS = 8192  # rows converted at a time


class FileEmbedding(nn.Module):
    """Token embedding read from the GGUF file: a lookup dequantizes the rows asked for from the
    file's own blocks, as llama.cpp's get_rows does, so the table is neither converted at load
    nor resident beyond the pages of the tokens used (a 151936 x 1536 Q4_K table is 131 MB).
    For files whose output layer is a tensor of its own; a tied table is the output layer's."""

    def __init__(self, path: Path, tensor: GGUFTensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = tensor.shape
        self._rows = tensor.rows_of(path)
        self._type = tensor.ggml_type

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden] float32
        from gguf.quants import dequantize

        flat = ids.reshape(-1).cpu().numpy()
        out = dequantize(self._rows[flat], self._type).astype(np.float32, copy=False)
        return torch.from_numpy(out).view(*ids.shape, self.embedding_dim)


def read_gguf(path: Path) -> dict[str, GGUFTensor]:
    """HF-named tensors of a GGUF file (unknown names, e.g. rope tables, are skipped)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            out[name] = GGUFTensor(t)
    return out


def load_tensors(path: Path, hf: dict[str, Any], quantization: str, lazy: tuple[str, ...] = ()
                 ) -> Iterator[tuple[str, torch.Tensor | QuantWeight | GGUFTensor]]:
    """(HF name, weight) for every tensor: QuantWeight for 2-D weights unless quantization is
    "none" (then float32), float32 for norms and biases; the tensors named in `lazy` as their
    GGUFTensor, unconverted. Llama q/k rows are un-permuted."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    llama = hf.get("model_type") == "llama" or "LlamaForCausalLM" in (hf.get("architectures") or [])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    for name, t in read_gguf(path).items():
        if name in lazy:
            yield name, t
            continue
        w = t.converted(quantization)
        if llama and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            h = heads if "q_proj" in name else kv_heads
            if isinstance(w, QuantWeight):  # re-packed in the un-permuted row order
                w = w.select(_llama_unpermute(torch.arange(w.rows), h))
            else:
                w = _llama_unpermute(w, h).contiguous()
        yield name, w
