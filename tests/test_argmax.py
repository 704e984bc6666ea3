"""The two-launch row argmax against torch.argmax (interpreter on the CPU, the GPU with
SPECDEC_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if ON_CUDA and not torch.cuda.is_available():
    pytest.skip("SPECDEC_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

from verify_kernels.argmax import argmax_triton  # noqa: E402

DEV = "cuda" if ON_CUDA else "cpu"

@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 4096), (2, 12289), (4, 7)])
def test_argmax_rows(rows, vocab):
    """First index of the maximum, as torch.argmax: ties inside a chunk and across chunks,
    all -inf rows."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g).round(decimals=1)  # plenty of ties
    x[0, vocab // 2] = x[0, -1] = x[0, 1] = 50.0  # the max three times, across chunks
    if rows > 1:
        x[1] = float("-inf")
    x = x.to(DEV, torch.bfloat16 if ON_CUDA else torch.float32)
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
    assert argmax_triton(x)[0] == 1
