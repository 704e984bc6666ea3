"""sd_attention (specdec/cpu_kernels/quant_matmul.c) against its PyTorch reference: every build
gives the same bits, close to the float64 reference, and a row's result does not depend on the
rows computed beside it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.cpu_kernels.attention import RowsView, attention_ref
from specdec.cpu_kernels.build import available_paths, library

BS = 16


def _case(gen: torch.Generator, hq: int, hkv: int, d: int, rows: list[tuple[int, int, int]]):
    """rows: (sequence, prefix length, extra slots) per query row; two sequences' blocks
    interleaved over a shuffled pool."""
    nblocks = 2 * (max(p + e for _, p, e in rows) // BS + 2)
    k = torch.randn(nblocks, BS, hkv, d, generator=gen)
    v = torch.randn(nblocks, BS, hkv, d, generator=gen)
    tables = torch.randperm(nblocks, generator=gen).to(torch.int32).view(2, -1)
    counts = torch.tensor([e for _, _, e in rows], dtype=torch.int64)
    ptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    extra = torch.cat([tables[s].long()[torch.randint(0, p // BS + 1, (e,), generator=gen)] * BS
                       + torch.randint(0, BS, (e,), generator=gen) for s, p, e in rows])
    view = RowsView(torch.tensor([s for s, _, _ in rows], dtype=torch.int32),
                    torch.tensor([p for _, p, _ in rows], dtype=torch.int32), ptr, extra)
    q = torch.randn(len(rows), hq, d, generator=gen)
    return q, k, v, tables, view


def _run(path: str, q, k, v, tables, view: RowsView) -> torch.Tensor:
    t, hq, d = q.shape
    out = torch.empty_like(q)
    library(path).sd_attention(q.data_ptr(), t, hq, k.shape[2], d, k.data_ptr(), v.data_ptr(),
                               tables.data_ptr(), tables.shape[1], BS, view.row_seq.data_ptr(),
                               view.row_prefix.data_ptr(), view.extra_ptr.data_ptr(),
                               view.extra_slots.data_ptr(), d ** -0.5, out.data_ptr())
    return out


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (14, 2, 64), (12, 2, 128)])
def test_attention_matches_the_reference_on_every_build(hq: int, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hq + d)
    # Short and long prefixes (under and over the prefetch distance), tree rows with extra
    # slots, two sequences.
    rows = [(0, 1, 0), (0, 7, 0), (1, 300, 0), (1, 40, 3), (0, 23, 1), (1, 0, 2)]
    q, k, v, tables, view = _case(gen, hq, hkv, d, rows)
    ref = attention_ref(q, k, v, SimpleNamespace(block_tables=tables), view, d ** -0.5)
    outs = [_run(p, q, k, v, tables, view) for p in available_paths()]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, outs[0])


def test_a_row_gets_the_same_bits_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [(0, 100, 0), (1, 33, 2), (0, 5, 1)]
    q, k, v, tables, view = _case(gen, 14, 2, 64, rows)
    together = _run("portable", q, k, v, tables, view)
    for r in range(len(rows)):
        lo, hi = int(view.extra_ptr[r]), int(view.extra_ptr[r + 1])
        one = RowsView(view.row_seq[r:r + 1], view.row_prefix[r:r + 1],
                       torch.tensor([0, hi - lo]), view.extra_slots[lo:hi].clone())
        for path in available_paths():
            assert torch.equal(_run(path, q[r:r + 1].clone(), k, v, tables, one), together[r:r + 1])


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (12, 2, 128), (16, 1, 32)])
def test_rows_of_one_sequence_read_together_get_the_bits_of_each_alone(hq, hkv, d) -> None:
    # A prefill chunk's causal rows (11 of them: a group of 8 and one of 3), prefixes around a
    # run of 16 keys, then a verification's tree rows, one with no prefix at all.
    gen = torch.Generator().manual_seed(hq * d)
    rows = ([(0, p, 0) for p in range(38, 49)]
            + [(1, 31, 1), (1, 31, 2), (1, 31, 2), (1, 32, 3), (1, 0, 2)])
    q, k, v, tables, view = _case(gen, hq, hkv, d, rows)
    ref = attention_ref(q, k, v, SimpleNamespace(block_tables=tables), view, d ** -0.5)
    for path in available_paths():
        together = _run(path, q, k, v, tables, view)
        torch.testing.assert_close(together, ref, rtol=1e-5, atol=1e-5)
        for r in range(len(rows)):
            lo, hi = int(view.extra_ptr[r]), int(view.extra_ptr[r + 1])
            one = RowsView(view.row_seq[r:r + 1], view.row_prefix[r:r + 1],
                           torch.tensor([0, hi - lo]), view.extra_slots[lo:hi].clone())
            assert torch.equal(_run(path, q[r:r + 1].clone(), k, v, tables, one),
                               together[r:r + 1]), (path, r)
