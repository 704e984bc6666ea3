"""A/B of builds of sd_attention (specdec/cpu_kernels/quant_matmul.c) in one process: each
variant compiled with the AVX-512 flags, then timed in turns on a decode step's attention (one
sequence's T query rows over its paged cache, one cache per layer so that keys and values stream
from memory as in a step), fastest of --passes passes, 2 threads; every variant's output is held
to the first's, bit for bit.

Shapes: the 1.5b target (12 query heads over 2 KV heads of 128, 28 layers) and the 0.5b draft
(14 over 2 of 64, 24 layers). Rows come as a chain verification lays them out (each row sees
the sequence up to itself: prefixes ctx + 1 .. ctx + T) or as a tree's (each row sees the
context and then its ancestors and itself as extra slots).

    PYTHONPATH=. python3 bench/investigations/cpu_attention_ab.py \
        old,/tmp/old.c new,specdec/cpu_kernels/quant_matmul.c [--out FILE]
A variant is NAME,SOURCE[,extra compiler flags...].
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import time
from pathlib import Path

import torch

from specdec.cpu_kernels import build

FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", *build._FLAGS["avx512"]]
LAYER_STEP = Path(build.__file__).with_name("layer_step.c")
BS = 16
SHAPES = {"target": (12, 2, 128, 28), "draft": (14, 2, 64, 24)}


def make(name: str, src: str, extra: list[str]) -> ctypes.CDLL:
    out = f"/tmp/attention_ab_{name}.so"
    subprocess.run([build._compiler(), *FLAGS, f"-I{LAYER_STEP.parent}", *extra, src,
                    str(LAYER_STEP), "-o", out, "-lm"], check=True)
    return build._argtypes(ctypes.CDLL(out))


def rows_view(ctx: int, t: int, tree: bool, slots: list[int]):
    """(row_prefix, extra_ptr, extra_slots) of t rows whose new keys sit at slots[ctx:ctx+t]."""
    if not tree:
        return (torch.arange(ctx + 1, ctx + t + 1, dtype=torch.int32),
                torch.zeros(t + 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    prefix = torch.full((t,), ctx, dtype=torch.int32)
    extra = [slots[ctx + e] for r in range(t) for e in range(r + 1)]  # a chain as a tree
    ptr = torch.tensor([0] + [sum(range(1, r + 2)) for r in range(t)], dtype=torch.int64)
    return prefix, ptr, torch.tensor(extra, dtype=torch.int64)


def case(shape: str, ctx: int, t: int, tree: bool):
    hq, hkv, d, layers = SHAPES[shape]
    gen = torch.Generator().manual_seed(ctx + t)
    nblocks = (ctx + t) // BS + 1
    pool = 4 * nblocks  # the sequence's blocks scattered over a larger cache
    table = torch.randperm(pool, generator=gen)[:nblocks].to(torch.int32).view(1, -1)
    slots = [int(table[0, p // BS]) * BS + p % BS for p in range(ctx + t)]
    caches = [(torch.randn(pool, BS, hkv, d, generator=gen),
               torch.randn(pool, BS, hkv, d, generator=gen)) for _ in range(layers)]
    q = torch.randn(t, hq, d, generator=gen)
    prefix, ptr, extra = rows_view(ctx, t, tree, slots)
    seq = torch.zeros(t, dtype=torch.int32)
    return q, caches, table, seq, prefix, ptr, extra


def run(lib: ctypes.CDLL, c, out: torch.Tensor) -> None:
    q, caches, table, seq, prefix, ptr, extra = c
    t, hq, d = q.shape
    for k, v in caches:
        lib.sd_attention(q.data_ptr(), t, hq, k.shape[2], d, k.data_ptr(), v.data_ptr(),
                         table.data_ptr(), table.shape[1], BS, seq.data_ptr(),
                         prefix.data_ptr(), ptr.data_ptr(), extra.data_ptr(), d ** -0.5,
                         out.data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--rows", default="1,2,3,5,8")
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    libs = {}
    for spec in a.variants:
        name, src, *extra = spec.split(",")
        libs[name] = make(name, src, extra)
    results = []
    for shape in SHAPES:
        for ctx in map(int, a.contexts.split(",")):
            for tree in (False, True):
                for t in map(int, a.rows.split(",")):
                    c = case(shape, ctx, t, tree)
                    outs = {v: torch.empty_like(c[0]) for v in libs}
                    best = dict.fromkeys(libs, float("inf"))
                    for _ in range(a.passes):
                        for v, lib in libs.items():
                            t0 = time.perf_counter()
                            run(lib, c, outs[v])
                            best[v] = min(best[v], time.perf_counter() - t0)
                    first = next(iter(outs.values()))
                    same = all(torch.equal(o, first) for o in outs.values())
                    row = {"shape": shape, "ctx": ctx, "rows": t,
                           "layout": "tree" if tree else "chain", "same_bits": same,
                           "ms": {v: round(s * 1e3, 3) for v, s in best.items()}}
                    results.append(row)
                    print(f"{shape:6s} ctx {ctx:5d} {row['layout']:5s} rows {t}: "
                          + " ".join(f"{v} {ms:.3f}" for v, ms in row["ms"].items())
                          + ("" if same else "  OUTPUTS DIFFER"), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"variants": a.variants, "results": results},
                                          indent=1))


if __name__ == "__main__":
    main()
