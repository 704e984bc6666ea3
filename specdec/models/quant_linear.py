"""Weight-only quantized linear layers and embeddings for the CPU.

A weight [N, K] is held in groups of 32 along K: integer values q, an fp16 scale d and an
optional fp16 offset mn per group, w = d * q + mn (`QuantWeight`). Two kinds: "q4" (4-bit q,
two per byte; what Q4_0, Q4_1 and Q4_K hold) and "q8" (int8 q; Q5_0, Q5_1 and Q8_0 exactly, other
types requantized). specdec/cpu_kernels/quant_matmul.c multiplies by it without expanding it:
activations are quantized to int8 per group of 32 and the dot products run on integers. A layer
whose weight came in parts of different kinds (a GGUF's q, k and v may differ) holds one
QuantWeight per part and writes each part's columns of the output.

The references here (`dequantize`, `quant_matmul_ref`) are what the tests hold the kernels to.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
KINDS = ("q4", "q8")


@dataclass
class QuantWeight:
    kind: str  # "q4" | "q8"
    qs: torch.Tensor  # q4: [N, K/2] uint8, q8: [N, K] int8, in quant_matmul.c's kernel order
    d: torch.Tensor  # [N, K/32] float16
    mn: torch.Tensor | None  # [N, K/32] float16, or None: symmetric
    n: int
    k: int

    @staticmethod
    def pack(kind: str, q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None
             ) -> QuantWeight:
        """From integer values q [N, K] (0..15 for q4, -128..127 for q8) and float scales and
        offsets [N, K/32]."""
        n, k = q.shape
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if k % 64:
            raise ValueError(f"quantized weights need K % 64 == 0, got K={k}")
        q = q[:, kernel_order(k)]
        full = (k // 256) * 256
        if kind == "q4":
            q = q.to(torch.uint8)
            blocks = q[:, :full].reshape(n, k // 256, 2, 2, 64)  # [N, NB, s // 2, s % 2, 64]
            tail = q[:, full:].reshape(n, -1, 2, 32)  # [N, pairs, half, 32]
            qs = torch.cat([(blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).reshape(n, -1),
                            (tail[:, :, 0] | (tail[:, :, 1] << 4)).reshape(n, -1)], dim=1)
        else:
            qs = q.to(torch.int8)
        half = torch.float16
        return QuantWeight(kind, qs.contiguous(), d.to(half).contiguous(),
                           None if mn is None else mn.to(half).contiguous(), n, k)

    def values(self) -> torch.Tensor:  # [N, K] int16: the integer q of every weight
        if self.kind == "q8":
            stored = self.qs.to(torch.int16)
        else:
            full = (self.k // 256) * 256
            b = self.qs[:, :full // 2].reshape(self.n, -1, 2, 1, 64)
            t = self.qs[:, full // 2:].reshape(self.n, -1, 1, 32)
            stored = torch.cat([torch.cat([b & 0xF, b >> 4], dim=3).reshape(self.n, -1),
                                torch.cat([t & 0xF, t >> 4], dim=2).reshape(self.n, -1)], dim=1)
            stored = stored.to(torch.int16)
        q = torch.empty_like(stored)
        q[:, kernel_order(self.k)] = stored
        return q

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] float32 (or the rows [R, K] given by index)."""
        w = self if rows is None else self.select(rows)
        q = w.values().float().view(-1, w.k // GROUP, GROUP)
        out = q * w.d.float()[..., None]
        if w.mn is not None:
            out = out + w.mn.float()[..., None]
        return out.view(-1, w.k)

    def select(self, rows: torch.Tensor) -> QuantWeight:
        mn = None if self.mn is None else self.mn[rows]
        return QuantWeight(self.kind, self.qs[rows], self.d[rows], mn, int(rows.numel()), self.k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.mn)
                   if t is not None)

    @staticmethod
    def random(kind: str, n: int, k: int, gen: torch.Generator, affine: bool = True
               ) -> QuantWeight:
        lo, hi = (0, 16) if kind == "q4" else (-127, 128)
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
    return xq.to(torch.int8).view(m, k), xd, xd * xq.sum(dim=-1)  # xq in natural order


def quant_matmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's result computed in PyTorch: [M, K] float32 -> [M, N] float32."""
    xq, xd, xs = quantize_activations(x)
    m = x.shape[0]
    q = w.values().to(torch.int32).view(w.n, w.k // GROUP, GROUP)
    a = xq.to(torch.int32).view(m, w.k // GROUP, GROUP)
    dots = torch.einsum("mgi,ngi->mng", a, q).float()  # [M, N, G], exact integers
    y = (dots * w.d.float()[None] * xd[:, None]).sum(-1)
    if w.mn is not None:
        y = y + xs @ w.mn.float().t()
    return y


@functools.cache
def kernel_order(k: int) -> torch.Tensor:
    """[K] int64: the natural index k of the value at each storage position of a row (the
    "kernel order" of quant_matmul.c): blocks of 256 where position 64 s + 4 l + i holds
    k = 32 (l & 7) + 16 (l >> 3) + 4 s + i, then a tail in natural order."""
    full = (k // 256) * 256
    s, lane, i = torch.meshgrid(torch.arange(4), torch.arange(16), torch.arange(4), indexing="ij")
    block = (32 * (lane & 7) + 16 * (lane >> 3) + 4 * s + i).reshape(256)
    starts = torch.arange(0, full, 256)[:, None]
    return torch.cat([(starts + block).reshape(-1), torch.arange(full, k)])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 isa: str = "auto", out: torch.Tensor | None = None, col: int = 0
                 ) -> torch.Tensor:
    """x [M, K] float32 @ w^T (+ bias [N]) -> [M, N] float32, or into columns col:col+N of
    `out` [M, >= col + N]."""
    from specdec.cpu_kernels.build import choose_isa, load

    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.shape, w.k)
    assert x.device.type == "cpu"
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out, col = torch.empty(m, w.n), 0
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape[0] == m
    assert out.shape[1] >= col + w.n
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (w.n,))
    lib = load(choose_isa() if isa == "auto" else isa)
    xq = torch.empty(m, w.k, dtype=torch.int8)
    xd = torch.empty(m, w.k // GROUP)
    xs = torch.empty(m, w.k // GROUP)
    lib.sd_quantize_rows(x.data_ptr(), m, w.k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    fn = lib.sd_q4_matmul if w.kind == "q4" else lib.sd_q8_matmul
    fn(xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), m, w.k, w.qs.data_ptr(), w.d.data_ptr(),
       _ptr(w.mn), _ptr(bias), w.n, ctypes.c_void_p(out.data_ptr() + 4 * col), out.shape[1])
    return out


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W in parts stacked along N (one QuantWeight each)."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, isa: str = "auto"
                 ) -> None:
        super().__init__()
        if len({p.k for p in parts}) != 1:
            raise ValueError("parts of one layer must share K")
        self.parts = parts
        self.out_features = sum(p.n for p in parts)
        self.in_features = parts[0].k
        self.bias = None if bias is None else bias.float().contiguous()
        self.isa = isa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        out = torch.empty(x2.shape[0], self.out_features)
        col = 0
        for p in self.parts:
            b = None if self.bias is None else self.bias[col:col + p.n]
            quant_matmul(x2, p, b, self.isa, out, col)
            col += p.n
        return out.view(*lead, self.out_features)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


class QuantEmbedding(nn.Module):
    """Row lookup in a quantized table, dequantizing only the rows asked for."""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.table = weight
        self.num_embeddings, self.embedding_dim = weight.n, weight.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32
        return self.table.dequantize(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
