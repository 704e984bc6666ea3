"""The same weight shapes in each quantized kind (q4, q5, q8: specdec/models/quant_linear.py),
timed in turns in one process on the AVX-512 path, 2 threads, 24 copies of each weight so that
they stream from memory, fastest of 7 passes: ms and GB/s read per row count. Shapes: the 0.5b
draft's gate/up (9728 x 896) and down (896 x 4864) projections.

    PYTHONPATH=. python3 bench/investigations/cpu_quant_kinds.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.models.quant_linear import KINDS, QuantActivations, QuantWeight

SHAPES = ((9728, 896), (896, 4864))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    results = []
    for n, k in SHAPES:
        ws = {kind: [QuantWeight.random(kind, n, k, gen) for _ in range(24)] for kind in KINDS}
        mb = {kind: sum(w.nbytes() for w in wl) / 1e6 for kind, wl in ws.items()}
        for rows in map(int, a.rows.split(",")):
            x, out = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
            best = dict.fromkeys(ws, float("inf"))
            for _ in range(7):
                for kind, wl in ws.items():
                    acts = QuantActivations(x, "avx512")
                    t = time.perf_counter()
                    for w in wl:
                        acts.matmul(w, None, out, 0)
                    best[kind] = min(best[kind], time.perf_counter() - t)
            row = {"n": n, "k": k, "rows": rows,
                   "ms": {kd: round(s * 1e3, 3) for kd, s in best.items()},
                   "mb": {kd: round(m, 1) for kd, m in mb.items()},
                   "gb_s": {kd: round(mb[kd] / best[kd] / 1e3, 1) for kd in best}}
            results.append(row)
            print(f"{n}x{k} rows {rows}: " + " ".join(
                f"{kd} {row['ms'][kd]:.2f} ms ({row['mb'][kd]:.0f} MB, {row['gb_s'][kd]} GB/s)"
                for kd in best), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
