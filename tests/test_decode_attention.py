"""The fused attention kernels of decode steps (verify_kernels/decode_attention.py) and of
small verification steps (verify_kernels/tree_attention.py): rotary, KV write, split-KV
attention (over the context and, for trees, the step's own rows under each sequence's mask) and
merge, against their reference. Interpreter in float32 on the CPU; bfloat16 on the GPU with
SPECDEC_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if ON_CUDA and not torch.cuda.is_available():
    pytest.skip("SPECDEC_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

from test_kernels import DEV, DTYPE, make_meta  # noqa: E402

from verify_kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from verify_kernels.tree_attention import MAX_Q, MAX_SEQS, fuses, tree_attention  # noqa: E402

TOL = {"atol": 4e-2, "rtol": 4e-2} if ON_CUDA else {"atol": 2e-5, "rtol": 2e-5}


def check(kernel, specs: list, hq: int, hkv: int, d: int, bs: int, splits: int, seed: int,
          pad: tuple[int, ...] = (), **kw) -> None:
    """Sequences (context, rows or tree parents) run their step through `kernel`; flattened
    rows in `pad` are padding (slot -1: nothing written, output unread, seen by no real row)."""
    g = torch.Generator().manual_seed(seed)
    meta, nb = make_meta(specs, bs, g)
    if pad:
        slots = meta.slot_mapping.clone()
        slots[list(pad)] = -1
        meta = type(meta)(**{**meta.__dict__, "slot_mapping": slots})
    t = sum(meta.q_lens_host)
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 3, generator=g).to(DEV, DTYPE)  # a fused row
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
    pos = torch.cat([c + 3 + torch.arange(n) for c, n in zip(meta.context_lens_host,
                                                               meta.q_lens_host)]).to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    kc_ref, vc_ref = kc.float(), vc.float()
    ref = decode_attention_ref(q.float(), k.float(), v.float(), pos, inv, 1.1, kc_ref, vc_ref,
                               meta)
    qkv_before = qkv.clone()
    out = kernel(q, k, v, pos, inv, 1.1, kc, vc, meta, num_splits=splits, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    keep = [i for i in range(t) if i not in pad]
    torch.testing.assert_close(out[keep].float(), ref[keep], **TOL)
    # The cache holds the rotated keys and the values at the real rows' slots, nothing else.
    torch.testing.assert_close(kc.float(), kc_ref, **TOL)
    torch.testing.assert_close(vc.float(), vc_ref, **TOL)
    assert torch.equal(qkv, qkv_before), "q, k and v are inputs only"


def run(ctxs: list[int], *args, **kw) -> None:
    """Sequences with these contexts decode one token each."""
    check(decode_attention, [(c, 1) for c in ctxs], *args, **kw)


@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 2, 64, 16), (32, 8, 128, 16), (7, 1, 64, 32)])
def test_decode_no_split(hq, hkv, d, bs):
    run([0, 1, 15, 16, 17, 70, 130], hq, hkv, d, bs, splits=1, seed=hq * d + bs)


@pytest.mark.parametrize("splits", [2, 3, 32])
def test_decode_split(splits):
    # Empty contexts, one tile, many tiles, contexts shorter than the split count's reach.
    run([0, 5, 63, 64, 65, 300, 1000], 8, 2, 64, 16, splits=splits, seed=splits)
    run([129, 2, 640], 32, 8, 128, 16, splits=splits, seed=100 + splits)


def test_decode_padding_rows_write_nothing():
    run([40, 0, 7, 0], 8, 2, 64, 16, splits=4, seed=3, pad=(1, 3))



def test_decode_tile_choices():
    """The tile and warp counts the benchmark times give the same result."""
    run([0, 70, 200], 8, 2, 64, 16, splits=4, seed=6, block_n=32, num_warps=8)
    run([0, 70, 200], 8, 2, 64, 16, splits=1, seed=7, block_n=16)


# Verification steps: the fused tree kernel (verify_kernels/tree_attention.py).


def tree(specs: list, *args, **kw) -> None:
    check(tree_attention, specs, *args, **kw)


TREE7 = [-1, 0, 0, 1, 1, 2, 2]  # 8 rows: a binary tree below the root


@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 2, 64, 16), (32, 8, 128, 16), (7, 1, 64, 32)])
def test_tree_no_split(hq, hkv, d, bs):
    tree([(0, TREE7), (17, 8), (70, TREE7), (130, [-1, 0, 1, 2, 3, 4, 5])], hq, hkv, d, bs,
         splits=1, seed=hq * d + bs)
    tree([(3, 3), (90, [-1, 0])], hq, hkv, d, bs, splits=1, seed=hq * d + bs + 1)


@pytest.mark.parametrize("splits", [2, 3, 32])
def test_tree_split(splits):
    # Empty contexts, one tile, many tiles, contexts shorter than the split count's reach.
    tree([(0, [-1, 0, 0]), (5, 4), (64, [-1, 0, 1]), (1000, 4)], 8, 2, 64, 16, splits=splits,
         seed=splits)
    tree([(65, [-1, -1, 0]), (1, 4)], 8, 2, 64, 16, splits=splits, seed=50 + splits)
    tree([(129, [-1]), (640, 2)], 32, 8, 128, 16, splits=splits, seed=100 + splits)


@pytest.mark.parametrize("splits,block_n", [(2, 16), (5, 32), (16, 32)])
def test_tree_tile_widths(splits, block_n):
    # One cached split or several beside the owner's; contexts of 0, under one tile, ragged.
    tree([(0, TREE7), (5, 8), (300, TREE7), (1000, 8)], 8, 2, 64, 16, splits=splits,
         seed=200 + splits, block_n=block_n)
    tree([(129, [-1, 0]), (16, 3)], 32, 8, 128, 16, splits=splits, seed=300 + splits,
         block_n=block_n)


def test_tree_warps():
    tree([(33, TREE7), (200, 8)], 8, 2, 64, 16, splits=4, seed=5, num_warps=4)
    tree([(33, [-1, 0, 0]), (200, 4)], 32, 8, 128, 16, splits=2, seed=6, num_warps=8)


@pytest.mark.parametrize("splits,row_blocks", [(1, 2), (9, 2), (3, 4)])
def test_tree_row_blocks(splits, row_blocks):
    """A program's rows split over row blocks that read the same tiles: one of them writes
    the step's keys and values, every one scores them for its own rows."""
    tree([(0, TREE7), (17, 8), (300, TREE7), (1000, 8)], 32, 8, 128, 16, splits=splits,
         seed=400 + splits, row_blocks=2, block_n=32, num_warps=4)
    tree([(70, TREE7), (5, [-1, 0, 1, 2, 3, 4, 5])], 7, 1, 64, 32, splits=splits,
         seed=500 + splits, row_blocks=row_blocks)
    tree([(40, [-1, 0, -1, -1]), (0, [-1, 0, -1, -1])], 8, 2, 64, 16, splits=splits,
         seed=600 + splits, pad=(3, 4, 5, 6, 7, 8, 9), row_blocks=2)
    with pytest.raises(AssertionError, match="row blocks"):
        tree([(9, [-1, 0])], 8, 2, 64, 16, splits=splits, seed=1, row_blocks=2)


def test_tree_row_blocks_default(monkeypatch):
    """Calls that name no row blocks take as many as leave BLOCK_ROWS rows each, at least one
    (8 rows x 4 heads: 2 blocks of 16; 2 rows x 4 heads: one block)."""
    import verify_kernels.tree_attention as ta

    monkeypatch.setattr(ta, "BLOCK_ROWS", 16)
    tree([(33, TREE7), (200, 8)], 8, 2, 64, 16, splits=4, seed=7)
    tree([(33, [-1]), (200, 2)], 8, 2, 64, 16, splits=4, seed=8)


@pytest.mark.parametrize("splits", [1, 9])
def test_tree_sixteen_rows(splits):
    """The kernel's largest steps (KERNEL_MAX_Q rows: a 15-node tree, the size of the
    benchmarks' 2-branch k = 7 trees), and 12 rows padded to 16 columns."""
    binary = [-1] + [(i - 1) // 2 for i in range(1, 15)]  # 15 nodes below the root
    tree([(0, binary), (300, 16)], 32, 8, 128, 16, splits=splits, seed=700 + splits)
    tree([(90, 12), (1000, binary[:11])], 8, 2, 64, 16, splits=splits, seed=800 + splits)


def test_tree_padding_rows_write_nothing():
    # As the graph runner pads: the last rows of a sequence (seen only by themselves) and a
    # whole sequence of context 0.
    eye_tail = [-1, 0, -1, -1]  # rows 3 and 4 hang off the root: no real row sees them
    tree([(40, eye_tail), (0, eye_tail)], 8, 2, 64, 16, splits=4, seed=3,
         pad=(3, 4, 5, 6, 7, 8, 9))


def test_step_rope_only_for_tree_kernel_steps():
    """The backend makes the step's rotary table where the tree kernel takes the step, and
    tree_attention given it writes what it writes when it makes its own."""
    from verify_kernels.backend import TritonAttentionBackend
    from verify_kernels.fused_ops import rope_table

    g = torch.Generator().manual_seed(1)
    be = TritonAttentionBackend()
    inv = (1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(DEV)
    pos = torch.cat([43 + torch.arange(4), 93 + torch.arange(4)]).to(DEV)  # as `check` makes
    tree_meta = make_meta([(40, [-1, 0, 0]), (90, 4)], 16, g)[0]
    table = be.step_rope(tree_meta, pos, inv, 1.1)
    assert table is not None and table.shape == (8, 2, 64)
    torch.testing.assert_close(table, rope_table(pos, inv, 1.1))
    assert be.step_rope(make_meta([(5, 1), (9, 1)], 16, g)[0], pos[:2], inv, 1.1) is None
    assert be.step_rope(make_meta([(5, 4), (9, 3)], 16, g)[0], pos[:7], inv, 1.1) is None
    be.fused_tree = False
    assert be.step_rope(tree_meta, pos, inv, 1.1) is None
    tree([(40, [-1, 0, 0]), (90, 4)], 8, 2, 64, 16, splits=3, seed=9,
         rope=rope_table(pos, inv, 1.1))


def test_fuses_only_uniform_small_steps():
    g = torch.Generator().manual_seed(0)
    assert fuses(make_meta([(5, 4), (9, [-1, 0, 0])], 16, g)[0])
    assert not fuses(make_meta([(5, 4), (9, 3)], 16, g)[0])  # ragged
    assert not fuses(make_meta([(5, 1), (9, 1)], 16, g)[0])  # decode: decode_attention's
    assert not fuses(make_meta([(5, MAX_Q + 1)], 16, g)[0])
    assert not fuses(make_meta([(5, 2)] * (MAX_SEQS + 1), 16, g)[0])
    # Rows times the group's query heads (padded to a power of two) per program.
    sixteen = make_meta([(5, 16)], 16, g)[0]
    assert fuses(sixteen, group=4) and not fuses(sixteen, group=7)
    assert fuses(make_meta([(5, 8)], 16, g)[0], group=7)
