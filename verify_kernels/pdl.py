"""Programmatic dependent launch (Hopper and later): a kernel starts before its predecessor ends
and reads, meanwhile, what its predecessor cannot change.

At batch 1 a decode step is ~200 kernels back to back, each a few to a hundred microseconds, and
each one's memory traffic ramps up only after the previous one has drained: the weights of a
matmul (never written during a step) and the old KV entries of an attention kernel (written by
earlier steps) could be in flight already. With PDL a kernel is launched once every program of
its predecessor has called `release`; until its own `wait` returns (its predecessor finished,
writes visible) it touches only such read-only data:

- the few-row matmul (skinny_gemm.py) loads its first weight tile before waiting;
- decode attention (decode_attention.py) loads its context length, block-table entries and
  first K/V tile before waiting; q, k and v of the step come after;
- the split merge is launched without PDL (it runs after the attention kernel, as usual).

Each of the others calls `release` right after its wait, so launches run at most one kernel ahead
(a kernel waiting early holds SM slots, and a deeper chain of them would crowd the one that
is running). A kernel launched without PDL (any PyTorch op) just runs after its predecessor.

Off unless the launcher's caller passes `pdl=True` (the model's FusedKernels, from the
engine's RuntimeConfig.pdl, which the CLIs set from SPECDEC_PDL=1), and then only at compute
capability 9 and up, never under the interpreter: on the H200 it made the batch-1 decode step
1% slower (4.22 against 4.18 ms) and the 8-row verification step 3% slower
(bench/results/gpu_decode_attn_h200_20261130_pdl.json). The loads it would overlap are issued
before the wait either way, which costs nothing without PDL.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1: Triton's own
    switch, which the kernel tests set on the CPU): launch options for the GPU do not apply."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device, enabled: bool = False) -> dict:
    """Launch keyword arguments: the kernel's USE_PDL constexpr and Triton's launch flag, on
    only when `enabled` and the device can."""
    if not enabled or device.type != "cuda" or interpreting():
        return {"USE_PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"USE_PDL": True, "launch_pdl": True} if _capable(index) else {"USE_PDL": False}


@triton.jit
def pdl_wait_release(USE_PDL: tl.constexpr):
    """Wait for the predecessor (its writes visible), then let the successor launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["interpreting", "pdl_args", "pdl_wait_release"]
