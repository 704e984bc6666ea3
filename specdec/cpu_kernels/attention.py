"""Attention on the CPU (sd_attention in quant_matmul.c): the rows of one sequence read its cache
together, and each row is computed on its own.

Each row's result depends only on its own query and the keys and values it may see, in sequence
order, never on the other rows of the step: a verified draft token gets exactly the attention it
would get when decoded alone. `RowsView` describes what each row sees; `attention_ref` is the
same computation in PyTorch, which the tests hold the kernel to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class RowsView:
    """Per query row r: its sequence (a row of the block tables), how many of the sequence's
    leading positions it sees, and then which extra cache slots, in order (its tree ancestors and
    itself, for a verification row)."""

    row_seq: torch.Tensor  # [T] int32
    row_prefix: torch.Tensor  # [T] int32
    extra_ptr: torch.Tensor  # [T + 1] int64
    extra_slots: torch.Tensor  # [nnz] int64

    @staticmethod
    def of(meta: AttentionMetadata) -> RowsView:
        seq, prefix, counts, extra = [], [], [], []
        start = 0
        for b, (q, ctx, off) in enumerate(zip(meta.q_lens_host, meta.context_lens_host,
                                              meta.mask_offsets_host)):
            seq.append(torch.full((q,), b, dtype=torch.int32))
            if off < 0:  # causal (or a single decode row): the sequence up to and with itself
                prefix.append(torch.arange(ctx + 1, ctx + q + 1, dtype=torch.int32))
                counts.append(torch.zeros(q, dtype=torch.int64))
            else:
                assert meta.custom_mask is not None
                mask = meta.custom_mask[off:off + q * q].view(q, q).cpu()
                prefix.append(torch.full((q,), ctx, dtype=torch.int32))
                counts.append(mask.sum(1).to(torch.int64))
                _, cols = mask.nonzero(as_tuple=True)  # row-major: each row's columns in order
                extra.append(meta.slot_mapping[start + cols].cpu())
            start += q
        c = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)
        ptr = torch.zeros(len(c) + 1, dtype=torch.int64)
        ptr[1:] = torch.cumsum(c, 0)
        cat = torch.cat
        return RowsView(cat(seq) if seq else torch.zeros(0, dtype=torch.int32),
                        cat(prefix) if prefix else torch.zeros(0, dtype=torch.int32), ptr,
                        cat(extra).to(torch.int64) if extra else torch.zeros(0, dtype=torch.int64))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, rows: RowsView, scale: float, path: str = "auto"
              ) -> torch.Tensor:
    """q [T, Hq, D] float32, caches [num_blocks, block_size, Hkv, D] float32 -> [T, Hq, D]."""
    from specdec.cpu_kernels.build import choose_path, library

    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    assert d % 16 == 0 and hq % hkv == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert rows.row_seq.numel() == t
    q = q.contiguous()
    tables = meta.block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    lib = library(choose_path(1) if path == "auto" else path)
    lib.sd_attention(q.data_ptr(), t, hq, hkv, d, k_cache.data_ptr(), v_cache.data_ptr(),
                     tables.data_ptr(), tables.shape[1], k_cache.shape[1],
                     rows.row_seq.data_ptr(), rows.row_prefix.data_ptr(),
                     rows.extra_ptr.data_ptr(), rows.extra_slots.data_ptr(), scale,
                     out.data_ptr())
    return out


def attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, rows: RowsView, scale: float) -> torch.Tensor:
    """The same, row by row in PyTorch (float64 sums: a reference, not a bitwise twin)."""
    t, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    kf, vf = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    out = torch.empty_like(q)
    for r in range(t):
        table = meta.block_tables[int(rows.row_seq[r])].long()
        pos = torch.arange(int(rows.row_prefix[r]))
        slots = torch.cat([table[pos // bs] * bs + pos % bs,
                           rows.extra_slots[rows.extra_ptr[r]:rows.extra_ptr[r + 1]]])
        k = kf[slots].double().repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
        v = vf[slots].double().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[r].double(), k) * scale, dim=-1)
        out[r] = torch.einsum("hs,shd->hd", p, v).to(q.dtype)
    return out


def usable(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] % 16 == 0 and \
        math.prod(q.shape) > 0


class CpuAttentionBackend:
    """The CPU backend: the row kernel for float32, PyTorch's reference for other dtypes or
    where the kernels cannot be built. A step's RowsView is built once and reused by its layers."""

    name = "cpu"

    def __init__(self, reference: object, path: str = "auto") -> None:
        self.path = path
        self.reference = reference  # the PyTorch backend, for what the kernel does not take
        self._rows: tuple[AttentionMetadata, RowsView] | None = None
        self._kernel_ok: bool | None = None

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.reference.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _kernel(self) -> bool:
        if self._kernel_ok is None:
            from specdec.cpu_kernels.build import KernelUnavailable, choose_path, library

            try:
                library(choose_path(1) if self.path == "auto" else self.path)
                self._kernel_ok = True
            except KernelUnavailable:
                self._kernel_ok = False
        return self._kernel_ok

    def rows(self, meta: AttentionMetadata) -> RowsView | None:
        """The step's RowsView (built once per step), or None where the kernel cannot run."""
        if not self._kernel():
            return None
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, RowsView.of(meta))
        return self._rows[1]

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        rows = self.rows(meta) if usable(q) and k_cache.dtype == torch.float32 else None
        if rows is None:
            return self.reference.attend(q, k_cache, v_cache, meta, scale)
        return attention(q, k_cache, v_cache, meta, rows, scale, self.path)
