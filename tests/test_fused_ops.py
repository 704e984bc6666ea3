"""Fused decoder kernels against their PyTorch references (interpreter on the CPU, float32)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from verify_kernels.fused_ops import (
    add_rmsnorm,
    add_rmsnorm_ref,
    rope_,
    rope_ref,
    silu_mul,
    silu_mul_ref,
)

DEV = "cuda" if os.environ.get("SPECDEC_TEST_DEVICE") == "cuda" else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
TOL = {"atol": 2e-2, "rtol": 2e-2} if DT == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("t,h,first", [(1, 64, True), (5, 96, False), (3, 128, False)])
def test_add_rmsnorm(t, h, first):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g).to(DEV, DT)
    res = None if first else torch.randn(t, h, generator=g).to(DEV, DT)
    w = torch.randn(h, generator=g).to(DEV, DT)
    ref_out, ref_res = add_rmsnorm_ref(x, None if first else res.clone(), w, 1e-6)
    out, new_res = add_rmsnorm(x, res, w, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new_res, ref_res, **TOL)


@pytest.mark.parametrize("t,heads,d", [(1, 2, 64), (4, 3, 128)])
def test_rope_in_place_on_strided_rows(t, heads, d):
    g = torch.Generator().manual_seed(d)
    buf = torch.randn(t, heads * d + 7, generator=g).to(DEV, DT)  # q inside a fused qkv row
    q = buf[:, :heads * d].view(t, heads, d)
    pos = torch.randint(0, 4000, (t,), generator=g).to(DEV)
    inv = (1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    ref = rope_ref(q.clone(), pos, inv, 1.1)
    tail = buf[:, heads * d:].clone()
    rope_(q, pos, inv, 1.1)
    torch.testing.assert_close(q, ref, **({"atol": 1e-4, "rtol": 1e-4} if DT == torch.float32
                                          else TOL))
    assert torch.equal(buf[:, heads * d:], tail)


@pytest.mark.parametrize("t,inter", [(1, 64), (3, 1500)])
def test_silu_mul(t, inter):
    gu = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEV, DT)
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), **TOL)


@pytest.mark.skipif(DEV == "cuda", reason="the CPU model check runs under the interpreter")
def test_fused_model_equals_eager(tiny_llama):
    from specdec.engine import LLMEngine
    from specdec.model_runner import Segment

    eng = LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"}, num_blocks=8)
    seg = Segment(list(range(1, 13)), list(range(12)), list(range(12)), 0, [0],
                  logits_rows=tuple(range(12)))
    eager = eng.runner.execute([seg]).logits
    eng.runner.model.fused = True
    fused = eng.runner.execute([seg]).logits
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)
