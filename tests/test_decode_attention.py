"""The fused decode attention kernel (rotary, KV write, split-KV attention, merge) against its
reference. Interpreter in float32 on the CPU; bfloat16 on the GPU with SPECDEC_TEST_DEVICE=cuda.
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

TOL = {"atol": 4e-2, "rtol": 4e-2} if ON_CUDA else {"atol": 2e-5, "rtol": 2e-5}


def run(ctxs: list[int], hq: int, hkv: int, d: int, bs: int, splits: int, seed: int,
        pad: tuple[int, ...] = (), **tiles) -> None:
    """Sequences with these contexts decode one token each; rows in `pad` are padding (slot
    -1: nothing written, output unread)."""
    g = torch.Generator().manual_seed(seed)
    meta, nb = make_meta([(c, 1) for c in ctxs], bs, g)
    if pad:
        slots = meta.slot_mapping.clone()
        slots[list(pad)] = -1
        meta = type(meta)(**{**meta.__dict__, "slot_mapping": slots})
    b = len(ctxs)
    qkv = torch.randn(b, (hq + 2 * hkv) * d + 3, generator=g).to(DEV, DTYPE)  # a fused row
    q = qkv[:, :hq * d].view(b, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(b, hkv, d)
    pos = torch.tensor([c + 3 for c in ctxs], dtype=torch.int64).to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    kc_ref, vc_ref = kc.float(), vc.float()
    ref = decode_attention_ref(q.float(), k.float(), v.float(), pos, inv, 1.1, kc_ref, vc_ref,
                               meta)
    qkv_before = qkv.clone()
    out = decode_attention(q, k, v, pos, inv, 1.1, kc, vc, meta, num_splits=splits, **tiles)
    assert out.shape == q.shape and out.dtype == q.dtype
    keep = [i for i in range(b) if i not in pad]
    torch.testing.assert_close(out[keep].float(), ref[keep], **TOL)
    # The cache holds the rotated keys and the values at the real rows' slots, nothing else.
    torch.testing.assert_close(kc.float(), kc_ref, **TOL)
    torch.testing.assert_close(vc.float(), vc_ref, **TOL)
    assert torch.equal(qkv, qkv_before), "q, k and v are inputs only"


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
