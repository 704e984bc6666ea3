"""Timing a model's pass by query rows at start, for the speculation controller's cost model
(specdec/cost_model.py): one segment of n rows at a 256-token context, on slots no request
holds yet, through whatever a step runs (CUDA graphs, the CPU kernels). The curve is cached per
machine, model, dtype, quantization, kernel, thread count and code digest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.step_inputs import Segment

if TYPE_CHECKING:
    from specdec.model_runner import ModelRunner

CONTEXT = 256  # tokens before the timed rows

# (run_pass, max_rows, cache) -> seconds by rows: CostModel.calibrate or .calibrate_drafter
Measure = Callable[[Callable[[int], None], int, "Path | None"], dict[int, float]]


def calibrate_runner(runner: ModelRunner, max_batched_tokens: int, measure: Measure
                     ) -> dict[int, float]:
    """Measure (or load from the cache) `runner`'s pass curve up to 128 rows (or as far as
    CALIBRATION_BUDGET_S allows) with `measure`; {} where its KV pool is too small to time even
    one row."""
    from specdec.cost_model import cache_file, code_digest, machine_name
    from specdec.hub.resolve import cache_root

    ctx, bs = CONTEXT, runner.block_size
    rows = min(max_batched_tokens, 128, runner.num_blocks * bs - ctx)
    if rows < 1:
        return {}
    mc, dev = runner.mc, runner.device

    def run_pass(n: int) -> None:
        # Slots no request holds yet (none is admitted): what they are left holding is
        # overwritten before any request reads it.
        runner.execute([Segment(
            tokens=[0] * n, positions=list(range(ctx, ctx + n)),
            slots=list(range(ctx, ctx + n)), context_len=ctx,
            block_table=list(range((ctx + n + bs - 1) // bs)),
            logits_rows=tuple(range(n)))])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else machine_name()
    cache = cache_file(cache_root() / "costs", machine=where, model=mc.model, dtype=mc.dtype,
                       quantization=mc.quantization, kernel=mc.cpu_kernel,
                       threads=torch.get_num_threads(), rows=rows, code=code_digest(),
                       version=2)
    return measure(run_pass, rows, cache)
