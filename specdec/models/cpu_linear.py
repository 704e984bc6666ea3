"""Linear layers on the CPU (float32, bfloat16) at the row counts of decoding.

At a few rows a linear layer only streams its weight, so it should run at the memory bandwidth.
PyTorch's default CPU path does not: MKL's matrix-vector kernel runs on one thread, and a
small-M `x @ W^T` takes a slow path. The fastest alternative depends on the shape, the row count
and the CPU (measured on the 2-core CI machine: oneDNN's kernel reads a single row's weights up to
2.7x faster, `W @ x^T` wins at 2 to 16 rows for narrow layers), so each (row bucket, shape) is
timed once on first use and the fastest candidate is kept, as oneDNN's and inductor's autotuners
do. All candidates compute the same product in the input's dtype; only the summation order
differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _aten(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _w_xt(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(w, x.t()) if b is None else torch.addmm(b[:, None], w, x.t())  # [N, M]
    return out.t().contiguous()


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


CANDIDATES: dict[str, LinearFn] = {"aten": _aten, "w_xt": _w_xt}
if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    CANDIDATES["onednn"] = _onednn

_CHOICE: dict[tuple[int, ...], str] = {}


def _bucket(rows: int) -> int | None:
    for b in (1, 4, 16, 64):
        if rows <= b:
            return b
    return None


# Timing one weight over and over measures the cache, not the memory: candidates are timed on
# enough copies of the weight to overflow the last-level cache, as a real forward pass does.
_COLD_BYTES = 96 << 20


def _time(fn: LinearFn, x: torch.Tensor, ws: list[torch.Tensor], b: torch.Tensor | None
          ) -> float:
    fn(x, ws[0], b)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for w in ws:
            fn(x, w, b)
        best = min(best, time.perf_counter() - t)
    return best


def _fastest(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> str:
    copies = max(1, min(64, _COLD_BYTES // (w.numel() * w.element_size())))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    times: dict[str, float] = {}
    for name, fn in CANDIDATES.items():
        try:
            times[name] = _time(fn, x, ws, b)
        except RuntimeError:  # a backend this build or CPU lacks
            continue
    return min(times, key=times.__getitem__)


def cpu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b [N]) -> [M, N] through the fastest kernel measured for this
    shape and dtype; rows past 64 take PyTorch's default path."""
    bucket = _bucket(x.shape[0])
    if bucket is None or x.dim() != 2:
        return F.linear(x, w, b)
    key = (bucket, w.shape[0], w.shape[1], b is not None, x.dtype, torch.get_num_threads())
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = _fastest(x, w, b)
    return CANDIDATES[name](x, w, b)


def choices() -> dict[tuple[int, ...], str]:
    """What was picked so far: (row bucket, N, K, has bias, dtype, threads) -> candidate."""
    return dict(_CHOICE)
