"""The C layers' SiLU (silu(gate) * up over one row of a decode step's MLP): scalar `expf`, as
layer_step.c had it, against `silu_fixed` (specdec/cpu_kernels/fixed_math.h), whose loop the
compiler vectorises; both compiled with the kernels' AVX-512 flags, one thread, fastest of
`--repeats`, over the presets' intermediate sizes (8960 for qwen2.5-coder-1.5b, 4864 for
0.5b), and the largest relative difference between the two.

    PYTHONPATH=. python3 bench/investigations/cpu_silu.py --out FILE.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_decode import machine_info

from specdec.cpu_kernels import build

C = r"""
#include <math.h>
#include <stdint.h>
#include "fixed_math.h"
void silu_expf(const float *g, const float *u, float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
void silu_vec(const float *g, const float *u, float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = silu_fixed(g[i]) * u[i];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8960,4864")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp, "silu.c"), Path(tmp, "silu.so")
        src.write_text(C)
        subprocess.run([build._compiler(), "-O3", "-fPIC", "-shared", *build._FLAGS["avx512"],
                        f"-I{build.HEADERS[0].parent}", str(src), "-o", str(so), "-lm"],
                       check=True)
        lib = ctypes.CDLL(str(so))
    p = ctypes.c_void_p
    out = {"what": "SiLU loop: scalar expf against silu_fixed", "date": time.strftime("%Y-%m-%d"),
           "machine": machine_info(1), "args": vars(args), "sizes": {}}
    for n in (int(s) for s in args.sizes.split(",")):
        g = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 4
        u = torch.randn(n, generator=torch.Generator().manual_seed(1))
        res = {name: torch.empty(n) for name in ("silu_expf", "silu_vec")}
        best = dict.fromkeys(res, float("inf"))
        for _ in range(args.repeats):
            for name, a in res.items():
                fn = getattr(lib, name)
                fn.argtypes = [p, p, p, ctypes.c_int64]
                t = time.perf_counter()
                fn(g.data_ptr(), u.data_ptr(), a.data_ptr(), n)
                best[name] = min(best[name], time.perf_counter() - t)
        rel = ((res["silu_expf"] - res["silu_vec"]).abs()
               / res["silu_expf"].abs().clamp_min(1e-30)).max().item()
        out["sizes"][n] = {"expf_us": round(best["silu_expf"] * 1e6, 2),
                           "fixed_us": round(best["silu_vec"] * 1e6, 2),
                           "max_rel_diff": rel}
        print(f"{n} values: expf {best['silu_expf'] * 1e6:.1f} us, silu_fixed "
              f"{best['silu_vec'] * 1e6:.1f} us, largest relative difference {rel:.2e}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
