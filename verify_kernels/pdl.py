"""Programmatic dependent launch (Hopper and later): the step's kernels overlap their launches.

A decode step at batch 1 is ~230 kernels of a few to a hundred microseconds each, and each one
would otherwise start only after its predecessor has fully drained. Launched with PDL, a kernel
is scheduled as soon as every program of its predecessor has signalled (`gdc_launch_dependents`,
issued first thing); its programs then block in `gdc_wait` until the predecessor has finished
and its writes are visible. Every kernel here waits before its first memory access, so the only
thing overlapped is launch and scheduling latency: results are unchanged, and a kernel launched
without PDL (any PyTorch op) simply runs after its predecessor as usual.

`ENABLED` None: on for CUDA devices of compute capability 9 or more, off elsewhere (and under
TRITON_INTERPRET); SPECDEC_PDL=0 or 1 in the environment forces it. Benchmarks set it to compare.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED: bool | None = {"0": False, "1": True}.get(os.environ.get("SPECDEC_PDL", ""))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if ENABLED is not None:
        return ENABLED
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments: the kernel's USE_PDL constexpr and Triton's launch flag."""
    on = use_pdl(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
