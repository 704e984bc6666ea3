"""Activation quantization (`sd_quantize_rows`, before every quantized matmul) in the two kernel
builds: the portable one, whose loop calls lrintf for every value (the AVX-512 build's loop until
its vectorised version), against the AVX-512 one; one row of each size a preset's decode step
quantizes, one thread, fastest of `--repeats`, and whether the two builds' outputs are equal.

    PYTHONPATH=. python3 bench/investigations/cpu_quantize_rows.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_decode import machine_info

from specdec.cpu_kernels import build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1536,8960,896,4864")
    ap.add_argument("--repeats", type=int, default=3000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {name: build.load(name) for name in ("portable", "avx512")}
    out = {"what": "sd_quantize_rows, one row: portable build against AVX-512 build",
           "date": time.strftime("%Y-%m-%d"), "machine": machine_info(1), "args": vars(args),
           "sizes": {}}
    for k in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)) * 3
        res = {name: (torch.empty(1, k, dtype=torch.int8), torch.empty(1, k // 32),
                      torch.empty(1, k // 32)) for name in libs}
        best = dict.fromkeys(libs, float("inf"))
        for _ in range(args.repeats):
            for name, lib in libs.items():
                xq, xd, xs = res[name]
                t = time.perf_counter()
                lib.sd_quantize_rows(x.data_ptr(), 1, k, xq.data_ptr(), xd.data_ptr(),
                                     xs.data_ptr())
                best[name] = min(best[name], time.perf_counter() - t)
        equal = all(torch.equal(a, b) for a, b in zip(res["portable"], res["avx512"]))
        out["sizes"][k] = {f"{name}_us": round(t * 1e6, 2) for name, t in best.items()}
        out["sizes"][k]["equal"] = equal
        print(f"{k} values: portable {best['portable'] * 1e6:.2f} us, avx512 "
              f"{best['avx512'] * 1e6:.2f} us (each with a ctypes call), outputs equal: {equal}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
