"""`pack_step` alone, in a tight loop: a batch-16 speculative step of 8 rows a sequence (block
tables of 64 blocks, one table in four growing each step, one shared chain mask), packed 200
times into a pageable buffer and, on a CUDA machine, into a pinned one; and the time to build
the step's 16 segments. Compare with `pack_step (in execute)` in gpu_engine's host profile: the
same work between two device steps.

    PYTHONPATH=. python3 bench/investigations/pack_step.py
"""

from __future__ import annotations

import time

import torch

from drafters.tree import ancestor_mask_of
from specdec.step_inputs import Layout, Segment, pack_step

BATCH, ROWS, WIDTH, BLOCK = 16, 8, 256, 16
STEPS = 200


def run(pinned: bool) -> tuple[float, float]:
    """(us per pack_step, us per building the step's segments)."""
    lay = Layout(BATCH, ROWS, WIDTH)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8, pin_memory=pinned)
    h64 = buf[:lay.at32].view(torch.int64).numpy()
    h32 = buf[lay.at32:lay.at_mask].view(torch.int32).numpy()
    hmask = buf[lay.at_mask:].view(torch.bool).numpy()
    mask = ancestor_mask_of(list(range(-1, ROWS - 2)))
    tables = [list(range(i * 70, i * 70 + 64)) for i in range(BATCH)]

    def segments(step: int) -> list[Segment]:
        out = []
        for i in range(BATCH):
            c, t = 1000 + step * 4, tables[i]
            if step % 4 == i % 4:
                t.append(5000 + step * BATCH + i)
            out.append(Segment(
                [5] * ROWS, [c] + [c + 1 + d for d in range(ROWS - 1)],
                [t[(c + j) // BLOCK] * BLOCK + (c + j) % BLOCK for j in range(ROWS)], c, t,
                mask=mask, logits_rows=tuple(range(ROWS))))
        return out

    written: list = [None] * BATCH
    steps = [segments(s) for s in range(STEPS)]
    t = time.perf_counter()
    for segs in steps:
        pack_step(segs, lay, h64, h32, hmask, written)
    pack_us = (time.perf_counter() - t) / STEPS * 1e6
    t = time.perf_counter()
    for _ in range(STEPS):
        segments(0)
    return pack_us, (time.perf_counter() - t) / STEPS * 1e6


def main() -> None:
    pack_us, build_us = run(False)
    print(f"pageable: pack_step {pack_us:.1f} us, building 16 segments {build_us:.1f} us")
    if torch.cuda.is_available():
        pack_us, build_us = run(True)
        print(f"pinned:   pack_step {pack_us:.1f} us, building 16 segments {build_us:.1f} us")


if __name__ == "__main__":
    main()
