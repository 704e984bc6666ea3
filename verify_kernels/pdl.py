"""Programmatic dependent launch (Hopper and later): the step's kernels overlap their launches.

A decode step at batch 1 is ~230 kernels of a few to a hundred microseconds each, and each one
would otherwise start only after its predecessor has fully drained. Launched with PDL, a kernel
is scheduled as soon as every program of its predecessor has signalled (`gdc_launch_dependents`,
issued first thing); its programs then block in `gdc_wait` until the predecessor has finished
and its writes are visible. Every kernel here waits before its first memory access, so the only
thing overlapped is launch and scheduling latency: results are unchanged, and a kernel launched
without PDL (any PyTorch op) simply runs after its predecessor as usual.

Off unless asked for (SPECDEC_PDL=1, or `ENABLED = True`; it needs compute capability 9 and
never runs under TRITON_INTERPRET): on an H200 it made the 1-row decode step 0.4% faster and the
8-row verification step 5% slower (bench/results/gpu_step_profile_h200_20261130_overlap.json).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED: bool = os.environ.get("SPECDEC_PDL", "0") == "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ENABLED and _capable(index)


def pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments: the kernel's USE_PDL constexpr and Triton's launch flag."""
    on = use_pdl(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
