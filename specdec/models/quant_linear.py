"""Weight-only quantized linear layers and embeddings for the CPU.

A weight [N, K] is held in groups of 32 along K: integer values q, an fp16 scale d and an
optional fp16 offset mn per group, w = d * q + mn (`QuantWeight`). Three kinds: "q4" (4-bit q,
two per byte; what Q4_0, Q4_1 and Q4_K hold), "q5" (5-bit q: the low 4 bits as q4 holds them
and a plane of fifth bits; Q5_0 and Q5_1) and "q8" (int8 q; Q8_0 exactly, other types
requantized). specdec/cpu_kernels/quant_matmul.c multiplies by it without expanding it:
activations are quantized to int8 per group of 32 and the dot products run on integers. A layer
whose weight came in parts of different kinds (a GGUF's q, k and v may differ) holds one
QuantWeight per part and writes each part's columns of the output.

The references here (`dequantize`, `quant_matmul_ref`) are what the tests hold the kernels to.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
KINDS = ("q4", "q5", "q8")
BITS = {"q4": 4, "q5": 5, "q8": 8}  # the kernels' name for a kind


UNIT = 16  # weight rows per unit (see quant_matmul.c)


@dataclass
class QuantWeight:
    kind: str  # "q4" | "q5" | "q8"
    # units: q4 [N/16, K/32, 256] uint8, q5 [N/16, K/32, 320] uint8, q8 [N/16, K/32, 512] int8
    qs: torch.Tensor
    d: torch.Tensor  # [N/16, K/32, 16] float16
    mn: torch.Tensor | None  # [N/16, K/32, 16] float16, or None: symmetric
    n: int  # rows stored, a multiple of 16 (pack pads with zero rows)
    k: int
    rows: int = -1  # rows that are real, before the padding (-1: all n)

    def __post_init__(self) -> None:
        if self.rows < 0:
            self.rows = self.n

    @staticmethod
    def pack(kind: str, q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None
             ) -> QuantWeight:
        """From integer values q [N, K] (0..15 for q4, 0..31 for q5, -128..127 for q8) and float
        scales and
        offsets [N, K/32]. Rows are padded with zeros up to a multiple of 16."""
        n, k = q.shape
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if k % GROUP:
            raise ValueError(f"quantized weights need K % 32 == 0, got K={k}")
        pad = -n % UNIT
        if pad:
            q = torch.cat([q, q.new_zeros(pad, k)])
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
            mn = None if mn is None else torch.cat([mn, mn.new_zeros(pad, mn.shape[1])])
        nb, g = (n + pad) // UNIT, k // GROUP
        # [NB, 16 rows i, G, 8 tile rows r, 4] -> [NB, G, r, i, 4]: tile row r holds k = 4r..4r+3
        t = q.reshape(nb, UNIT, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(nb, g, 8, 64)
        if kind != "q8":
            t = t.to(torch.uint8)
            low = t & 0xF
            qs = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(nb, g, 256)
            if kind == "q5":  # tile row r's fifth bits: bit c of the uint64 at 256 + 8 r
                bits = ((t >> 4) & 1).view(nb, g, 8, 8, 8) << torch.arange(8, dtype=torch.uint8)
                qs = torch.cat([qs, bits.sum(-1, dtype=torch.uint8).view(nb, g, 64)], -1)
        else:
            qs = t.to(torch.int8).reshape(nb, g, 512)

        def units(v: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G, 16] float16
            return v.to(torch.float16).reshape(nb, UNIT, g).transpose(1, 2).contiguous()

        return QuantWeight(kind, qs.contiguous(), units(d), None if mn is None else units(mn),
                           n + pad, k, n)

    def values(self) -> torch.Tensor:  # [N, K] int16: the integer q of every weight
        nb, g = self.n // UNIT, self.k // GROUP
        if self.kind == "q8":
            t = self.qs.view(nb, g, 8, 64).to(torch.int16)
        else:
            b = self.qs[..., :256].reshape(nb, g, 4, 1, 64)
            t = torch.cat([b & 0xF, b >> 4], dim=3).view(nb, g, 8, 64).to(torch.int16)
            if self.kind == "q5":
                bits = self.qs[..., 256:].reshape(nb, g, 8, 8, 1).to(torch.int16)
                t = t | (((bits >> torch.arange(8, dtype=torch.int16)) & 1) << 4).view(
                    nb, g, 8, 64)
        return t.view(nb, g, 8, UNIT, 4).permute(0, 3, 1, 2, 4).reshape(self.n, self.k)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([N, G], [N, G] | None)
        def rows(v: torch.Tensor) -> torch.Tensor:
            return v.transpose(1, 2).reshape(self.n, self.k // GROUP)

        return rows(self.d), None if self.mn is None else rows(self.mn)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] float32 (or the rows [R, K] given by index)."""
        q = self.values().float().view(self.n, self.k // GROUP, GROUP)
        d, mn = self.scales()
        out = q * d.float()[..., None]
        if mn is not None:
            out = out + mn.float()[..., None]
        out = out.view(self.n, self.k)
        return out if rows is None else out[rows]

    def select(self, rows: torch.Tensor) -> QuantWeight:
        """The weight made of the given rows, in order (re-packed into units)."""
        assert int(rows.max()) < self.rows
        d, mn = self.scales()
        return QuantWeight.pack(self.kind, self.values()[rows], d[rows].float(),
                                None if mn is None else mn[rows].float())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.mn)
                   if t is not None)

    @staticmethod
    def random(kind: str, n: int, k: int, gen: torch.Generator, affine: bool = True
               ) -> QuantWeight:
        lo, hi = {"q4": (0, 16), "q5": (0, 32)}.get(kind, (-127, 128))
        q = torch.randint(lo, hi, (n, k), generator=gen)
        d = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3
        mn = -d * 8 + torch.randn(n, k // GROUP, generator=gen) * 1e-3 if affine else None
        return QuantWeight.pack(kind, q, d, mn)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K] int8, xd [M, K/32], xs [M, K/32]): the kernel's own
    arithmetic (scale = absmax / 127, round half to even), in PyTorch."""
    m, k = x.shape
    g = x.view(m, k // GROUP, GROUP)
    xd = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(xd > 0, 1.0 / xd, torch.zeros_like(xd))
    xq = torch.round(g * inv[..., None]).clamp(-127, 127)
    return xq.to(torch.int8).view(m, k), xd, xd * xq.sum(dim=-1)


def quant_matmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's result computed in PyTorch: [M, K] float32 -> [M, N] float32."""
    xq, xd, xs = quantize_activations(x)
    m = x.shape[0]
    q = w.values().to(torch.int32).view(w.n, w.k // GROUP, GROUP)
    a = xq.to(torch.int32).view(m, w.k // GROUP, GROUP)
    dots = torch.einsum("mgi,ngi->mng", a, q).float()  # [M, N, G], exact integers
    d, mn = w.scales()
    y = (dots * d.float()[None] * xd[:, None]).sum(-1)
    if mn is not None:
        y = y + xs @ mn.float().t()
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 path: str = "auto", out: torch.Tensor | None = None, col: int = 0
                 ) -> torch.Tensor:
    """x [M, K] float32 @ w^T (+ bias [N]) -> [M, N] float32, or into columns col:col+N of
    `out` [M, >= col + N]. `path`: "portable", "avx2", "avx512", "amx" or "auto" (the fastest
    measured for this row count, specdec/cpu_kernels/build.py); every path gives the same
    result."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.shape, w.k)
    m = x.shape[0]
    if out is None:
        out, col = torch.empty(m, w.n), 0
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape[0] == m
    assert out.shape[1] >= col + w.n
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (w.n,))
    acts = QuantActivations(x, path)
    acts.matmul(w, bias, out, col)
    return out


class QuantActivations:
    """x [M, K] float32 quantized once (int8 per group of 32) for any number of matmuls."""

    def __init__(self, x: torch.Tensor, path: str = "auto") -> None:
        from specdec.cpu_kernels.build import PATHS, choose_path, library

        self.x = x.contiguous()
        m, k = self.x.shape
        self.path = choose_path(m) if path == "auto" else path
        self.code = PATHS[self.path]
        self.lib = library(self.path)
        self.m, self.k = m, k
        self.xq = torch.empty(m, k, dtype=torch.int8)
        self.xd = torch.empty(m, k // GROUP)
        self.xs = torch.empty(m, k // GROUP)
        self.lib.sd_quantize_rows(self.x.data_ptr(), m, k, self.xq.data_ptr(),
                                  self.xd.data_ptr(), self.xs.data_ptr())

    def matmul(self, w: QuantWeight, bias: torch.Tensor | None, out: torch.Tensor,
               col: int) -> None:
        """out[:, col:col + w.n] = x @ w^T (+ bias); out [M, >= col + w.n] float32."""
        fn = getattr(self.lib, f"sd_q{BITS[w.kind]}_matmul")
        fn(self.xq.data_ptr(), self.xd.data_ptr(), self.xs.data_ptr(), self.m, self.k,
           w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.mn), _ptr(bias), w.n,
           ctypes.c_void_p(out.data_ptr() + 4 * col), out.shape[1], self.code)


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W in parts stacked along N (one QuantWeight each)."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, path: str = "auto",
                 out_features: int | None = None) -> None:
        super().__init__()
        if len({p.k for p in parts}) != 1:
            raise ValueError("parts of one layer must share K")
        self.parts = parts
        self.width = sum(p.n for p in parts)  # padded to units of 16 rows per part
        self.out_features = out_features or sum(p.rows for p in parts)
        # the real columns among the padded ones (None: they are the first out_features)
        self.columns: torch.Tensor | None = None
        if any(p.rows != p.n for p in parts[:-1]):
            starts = torch.tensor([0] + [p.n for p in parts[:-1]]).cumsum(0)
            self.columns = torch.cat([s + torch.arange(p.rows) for s, p in zip(starts, parts)])
        self.in_features = parts[0].k
        if bias is not None:  # laid out like the padded output
            chunks, col = [], 0
            for p in parts:
                chunks += [bias[col:col + p.rows].float(), torch.zeros(p.n - p.rows)]
                col += p.rows
            bias = torch.cat(chunks)
        self.bias = None if bias is None else bias.float().contiguous()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        out = torch.empty(x2.shape[0], self.width)
        acts = QuantActivations(x2, self.path)  # quantized once for every part
        col = 0
        for p in self.parts:
            acts.matmul(p, None if self.bias is None else self.bias[col:col + p.n], out, col)
            col += p.n
        if self.columns is not None:
            out = out.index_select(1, self.columns)
        elif self.width != self.out_features:
            out = out[:, :self.out_features]
        return out.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


class QuantEmbedding(nn.Module):
    """Row lookup in a quantized table, dequantizing only the rows asked for."""

    def __init__(self, weight: QuantWeight, num_embeddings: int) -> None:
        super().__init__()
        self.table = weight
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32
        return embed_rows(self.table, ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


def embed_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Dequantize only the rows `ids` [R] of w -> [R, K] float32."""
    blk, i = ids // UNIT, ids % UNIT  # unit row block and row within it
    g, rows = w.k // GROUP, torch.arange(len(ids))
    if w.kind == "q8":
        t = w.qs[blk].view(-1, g, 8, UNIT, 4)[rows, :, :, i]  # [R, G, 8, 4]
        q = t.to(torch.float32)
    else:
        units = w.qs[blk]
        b = units[..., :256].reshape(-1, g, 4, UNIT, 4)[rows, :, :, i]  # [R, G, 4, 4]
        q = torch.stack([b & 0xF, b >> 4], dim=3).to(torch.float32)  # [R, G, 4, 2, 4]
        if w.kind == "q5":  # row i's bits: byte i // 2 of each tile row, bits 4 (i % 2) + 0..3
            byte = units[..., 256:].reshape(-1, g, 8, 8)[rows, :, :, i // 2]  # [R, G, 8]
            shift = (4 * (i % 2))[:, None, None, None] + torch.arange(4)
            fifth = (byte[..., None].to(torch.int32) >> shift) & 1  # [R, G, 8, 4]
            q = q + 16 * fifth.view(len(ids), g, 4, 2, 4).to(torch.float32)
    q = q.reshape(len(ids), g, GROUP)
    out = q * w.d[blk, :, i].float()[..., None]
    if w.mn is not None:
        out = out + w.mn[blk, :, i].float()[..., None]
    return out.reshape(len(ids), w.k)
