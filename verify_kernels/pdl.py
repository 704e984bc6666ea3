"""Programmatic dependent launch (Hopper and later): the step's kernels overlap their launches,
and a matmul streams its weights into L2 while the kernels before it still run.

A decode step at batch 1 is ~230 kernels of a few to a hundred microseconds each; each would
otherwise start only after its predecessor has fully drained. Launched with PDL, a kernel is
scheduled once every program of its predecessor has signalled (`gdc_launch_dependents`); its
programs then block in `gdc_wait` until the predecessor has finished and its writes are
visible. Nothing before `gdc_wait` touches memory the step writes, so results are unchanged;
a kernel launched without PDL (any PyTorch op) runs after its predecessor as usual.

Where each kernel signals:
- the small latency-bound kernels (rotary + KV write, attention, its split merge, norms) signal
  on entry, so the launches run ahead of them up to the next matmul;
- a matmul signals only after its wait, so at most one matmul waits ahead; with `PREFETCH` that
  matmul's programs first ask for their weight rows to be brought into L2 (weights are never
  written by the step), so the weights of o_proj arrive while attention runs, and each matmul's
  first tiles while the previous matmul drains.

Off unless asked for (SPECDEC_PDL=1, or `ENABLED = True`; compute capability 9 or more, never
under TRITON_INTERPRET). See bench/gpu_step_profile.py for the measured effect.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED: bool = os.environ.get("SPECDEC_PDL", "0") == "1"
PREFETCH: bool = os.environ.get("SPECDEC_PDL_PREFETCH", "1") == "1"


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
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


def prefetch_ok(weight: torch.Tensor) -> bool:
    """Whether a matmul may prefetch `weight` [N, K]: PDL on, rows contiguous and 16-byte
    aligned (what the bulk prefetch needs)."""
    return (PREFETCH and use_pdl(weight.device) and weight.is_contiguous()
            and (weight.shape[1] * weight.element_size()) % 16 == 0
            and weight.data_ptr() % 16 == 0)


@triton.jit
def gdc_enter(USE_PDL: tl.constexpr, SIGNAL_FIRST: tl.constexpr):
    """Kernel entry under PDL: wait for the predecessor; signal dependents before the wait
    (small kernels) or after it (matmuls)."""
    if USE_PDL:
        if SIGNAL_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not SIGNAL_FIRST:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, nbytes):
    """One thread of the program asks for `nbytes` (a multiple of 16) from `ptr` into L2."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
