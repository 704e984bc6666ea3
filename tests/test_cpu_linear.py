"""The CPU linear kernels picked by timing all compute the same product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models import cpu_linear as cl


@pytest.mark.parametrize("rows", [1, 3, 16, 40, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_every_candidate_matches_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)  # [M, K]
    w = torch.randn(200, 96, generator=g)  # [N, K]
    b = torch.randn(200, generator=g) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    for name, fn in cl.CANDIDATES.items():
        out = fn(x, w, b)
        assert out.shape == (rows, 200) and out.is_contiguous(), name
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(cl.cpu_linear(x, w, b), ref, rtol=1e-4, atol=1e-4)


def test_choice_is_remembered_per_bucket() -> None:
    w = torch.randn(64, 32)
    cl.cpu_linear(torch.randn(2, 32), w, None)
    cl.cpu_linear(torch.randn(3, 32), w, None)  # same bucket: no second timing
    keys = [k for k in cl.choices() if k[1:3] == (64, 32)]
    assert len(keys) == 1 and keys[0][0] == 4
    assert cl.choices()[keys[0]] in cl.CANDIDATES
