"""Timing a model's pass by query rows at start, for the speculation controller's cost model
(specdec/cost_model.py): n rows in the shape a decode step gives them (sequences of at most
SEGMENT_ROWS rows, each at a 256-token context), on slots no request holds yet, through
whatever a step runs (CUDA graphs, the CPU kernels). The curve is cached per
machine, model, dtype, quantization, kernel, thread count and code digest."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.model_runner import ModelRunner

CONTEXT = 256  # tokens before the timed rows
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
CALIBRATION_PASSES = 3  # per row count, the fastest kept
# Rows per timed sequence: a step of more is timed as a batch of sequences drafting 7 deep. One
# segment of 96 or 128 rows fits no CUDA graph bucket and ran eagerly at 10-23 ms on an H100,
# where 16 sequences of 9 rows replay a graph in about 8 ms: priced by it, the controller never
# drafted deep at batch 16 or at all at batch 64 (bench/results/HISTORY.md, 2026-12-06).
SEGMENT_ROWS = 8
# Seconds one curve's calibration may take: the sizes past it are left to the curve's slope. A
# 135m model on the portable kernels (a CPU without AVX-512) took over 200 s to 128 rows and
# held its server's first start past five minutes; the default 1.5b target on AVX-512 takes
# about 12 s to 128 rows.
CALIBRATION_BUDGET_S = 20.0

# (run_pass, max_rows, cache) -> seconds by rows: CostModel.calibrate or DraftCosts.calibrate
Measure = Callable[[Callable[[int], None], int, "Path | None"], dict[int, float]]


def calibrate_runner(runner: ModelRunner, max_batched_tokens: int, measure: Measure
                     ) -> dict[int, float]:
    """Measure (or load from the cache) `runner`'s pass curve up to 128 rows (or as far as
    CALIBRATION_BUDGET_S allows) with `measure`; {} where its KV pool is too small to time even
    one row."""
    from specdec.hub.resolve import cache_root
    from specdec.step_inputs import Segment  # here: step_inputs -> drafters -> runner -> us

    ctx, bs = CONTEXT, runner.block_size
    span = -(-(ctx + SEGMENT_ROWS) // bs)  # blocks each timed sequence holds
    rows = min(max_batched_tokens, 128, runner.num_blocks // span * SEGMENT_ROWS)
    if rows < 1:
        return {}
    mc, dev = runner.mc, runner.device

    def run_pass(n: int) -> None:
        # Slots no request holds yet (none is admitted): what they are left holding is
        # overwritten before any request reads it.
        segments = []
        for i, start in enumerate(range(0, n, SEGMENT_ROWS)):
            q = min(SEGMENT_ROWS, n - start)
            table = list(range(i * span, i * span + -(-(ctx + q) // bs)))
            segments.append(Segment(
                tokens=[0] * q, positions=list(range(ctx, ctx + q)),
                slots=[i * span * bs + p for p in range(ctx, ctx + q)], context_len=ctx,
                block_table=table, logits_rows=tuple(range(q))))
        runner.execute(segments)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else machine_name()
    cache = cache_file(cache_root() / "costs", machine=where, model=mc.model, dtype=mc.dtype,
                       quantization=mc.quantization, kernel=mc.cpu_kernel,
                       threads=torch.get_num_threads(), rows=rows, code=code_digest(),
                       version=3)
    return measure(run_pass, rows, cache)


def measure_curve(run_pass: Callable[[int], None], max_rows: int, cache: Path | None
                  ) -> dict[int, float]:
    """Seconds of `run_pass(n)` by n, the fastest of CALIBRATION_PASSES, over CALIBRATION_ROWS
    up to `max_rows` and CALIBRATION_BUDGET_S; read from `cache` where it holds that curve."""
    rows = [r for r in CALIBRATION_ROWS if r <= max_rows]
    curve: dict[int, float] | None = None
    if cache is not None and cache.is_file():
        try:
            stored = json.loads(cache.read_text())
            curve = {int(r): float(s) for r, s in stored["pass_seconds"].items()}
            if stored.get("asked") != rows and not all(r in curve for r in rows):
                curve = None  # measured for other sizes
        except (OSError, ValueError, KeyError, TypeError):
            curve = None
    if curve is None:
        run_pass(1)  # warm-up: first-call allocations and kernel builds
        curve = {}
        t0 = time.perf_counter()
        for r in rows:
            best = float("inf")
            for _ in range(CALIBRATION_PASSES):
                t = time.perf_counter()
                run_pass(r)
                best = min(best, time.perf_counter() - t)
            curve[r] = best
            if time.perf_counter() - t0 > CALIBRATION_BUDGET_S:
                break  # the larger sizes: the curve's slope past the largest measured
        if cache is not None:
            _write_atomic(cache, {"pass_seconds": {str(r): s for r, s in curve.items()},
                                  "asked": rows,
                                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    # A pass over fewer rows never costs more than one over more: a spike (a page fault, the
    # other core busy; a fresh machine's first start read 1.75 s at 6 rows against 0.20 s at
    # 8) is cut down to the cheapest larger size.
    out: dict[int, float] = {}
    cheapest = float("inf")  # the cheapest size above r
    for r in reversed([r for r in rows if r in curve]):
        cheapest = out[r] = min(curve[r], cheapest)
    return dict(sorted(out.items()))


def cache_file(root: Path, **key: object) -> Path:
    """Where a pass curve measured under `key` (machine, model, dtype, ...) is kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return root / f"pass_{digest[:16]}.json"


@functools.cache
def code_digest() -> str:
    """A digest of the source that runs a pass (the engine, the models and the CPU and GPU
    kernels: every .py and .c file of the specdec and verify_kernels packages)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for pkg in (root, root.parent / "verify_kernels"):
        for f in sorted(pkg.rglob("*")):
            if f.suffix in (".py", ".c") and f.is_file():
                h.update(f.relative_to(pkg).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def machine_name() -> str:
    """The CPU's model name (what /proc/cpuinfo reports) and its core count."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name or 'unknown cpu'} x{os.cpu_count()}"


def _write_atomic(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next start a calibration
        pass
