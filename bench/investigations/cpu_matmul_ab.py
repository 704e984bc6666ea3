"""A/B of builds of specdec/cpu_kernels/quant_matmul.c in one process: each variant compiled
with the AVX-512 flags, then timed alternately on the 1.5b preset's matmul shapes (q4 and q8,
17920 x 1536 and 1536 x 8960, several weight copies so they stream from memory), fastest of 12
passes per row count, 2 threads.

    git show 9084426~1:specdec/cpu_kernels/quant_matmul.c > /tmp/old.c
    python bench/investigations/cpu_matmul_ab.py old,/tmp/old.c \
        new,specdec/cpu_kernels/quant_matmul.c
A variant is NAME,SOURCE[,extra compiler flags...]; a first flag `isa=BUILD` (`avx2`,
`portable`) compiles it with that build's flags instead of the AVX-512 ones. With
`--draft-stack` first: the 0.5b draft model's 24 layers of int4 matmuls instead, as one stack
(`bench_draft_stack`).
"""

import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.cpu_kernels import build

ROWS = (1, 2, 3, 4, 5, 8)
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp"]
LAYER_STEP = Path(build.__file__).with_name("layer_step.c")


def make(name: str, src: str, extra: list[str]) -> ctypes.CDLL:
    out = f"/tmp/matmul_ab_{name}.so"
    isa = "avx512"
    if extra and extra[0].startswith("isa="):
        isa, extra = extra[0][4:], extra[1:]
    flags = [*BASE_FLAGS, *build._FLAGS[isa]]
    # The kernels' headers are found beside them, wherever the variant's source lies.
    subprocess.run([build._compiler(), *flags, f"-I{LAYER_STEP.parent}", *extra, src,
                    str(LAYER_STEP), "-o", out, "-lm"], check=True)
    return build._argtypes(ctypes.CDLL(out))


def bench(variants: dict[str, ctypes.CDLL], kind: int, n: int, k: int, copies: int) -> None:
    gen = torch.Generator().manual_seed(0)
    units, ub = (n // 16) * (k // 32), 256 if kind == 4 else 512
    ws = [(torch.randint(0, 256 if kind == 4 else 127, (units * ub,), dtype=torch.uint8,
                         generator=gen), (torch.rand(units * 16, generator=gen) * 0.01).half())
          for _ in range(copies)]
    xs = {r: (torch.randint(-127, 128, (r, k), dtype=torch.int8, generator=gen),
              torch.rand(r, k // 32), torch.rand(r, k // 32), torch.empty(r, n)) for r in ROWS}
    best = {(v, r): float("inf") for v in variants for r in ROWS}
    for _ in range(12):
        for v, lib in variants.items():
            fn = lib.sd_q4_matmul if kind == 4 else lib.sd_q8_matmul
            for r in ROWS:
                xq, xd, xs_, y = xs[r]
                t = time.perf_counter()
                for qs, d in ws:
                    fn(xq.data_ptr(), xd.data_ptr(), xs_.data_ptr(), r, k, qs.data_ptr(),
                       d.data_ptr(), d.data_ptr(), None, n, y.data_ptr(), n, 1)
                best[v, r] = min(best[v, r], (time.perf_counter() - t) / copies)
    for v in variants:
        print(f"{v:8s} q{kind} {n}x{k} ms by rows: "
              + " ".join(f"{r}:{best[v, r] * 1e3:.3f}" for r in ROWS))


def bench_draft_stack(variants: dict[str, ctypes.CDLL], passes: int = 40) -> None:
    """The 0.5b draft model's 24 layers of int4 matmuls (q, k and v in one call, o, gate and
    up in one, down) back to back, each layer its own weights (183 MB: they stream from
    memory), at 1 and 5 rows: the fastest and the median of `passes` whole stacks per variant,
    the variants taking turns stack by stack."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
    layers = [[(n, k, torch.randint(0, 256, ((n // 16) * (k // 32) * 256,), dtype=torch.uint8,
                                    generator=gen),
                (torch.rand((n // 16) * (k // 32) * 16, generator=gen) * 0.01).half())
               for n, k in shapes] for _ in range(24)]
    rows = (1, 5)
    xs = {(r, k): (torch.randint(-127, 128, (r, k), dtype=torch.int8, generator=gen),
                   torch.rand(r, k // 32), torch.rand(r, k // 32))
          for r in rows for k in (896, 4864)}
    ys = {r: torch.empty(r, 9728) for r in rows}
    times = {(v, r): [] for v in variants for r in rows}
    for _ in range(passes):
        for v, lib in variants.items():
            for r in rows:
                t = time.perf_counter()
                for layer in layers:
                    for n, k, qs, d in layer:
                        xq, xd, xs_ = xs[r, k]
                        lib.sd_q4_matmul(xq.data_ptr(), xd.data_ptr(), xs_.data_ptr(), r, k,
                                         qs.data_ptr(), d.data_ptr(), d.data_ptr(), None, n,
                                         ys[r].data_ptr(), n, 1)
                times[v, r].append(time.perf_counter() - t)
    for v in variants:
        print(f"{v:8s} draft stack (24 layers, q4) ms by rows: " + " ".join(
            f"{r}: best {min(times[v, r]) * 1e3:.3f} median "
            f"{statistics.median(times[v, r]) * 1e3:.3f}" for r in rows))


def main() -> None:
    args = sys.argv[1:]
    stack = args[:1] == ["--draft-stack"]
    variants = {}
    for spec in args[1:] if stack else args:
        name, src, *extra = spec.split(",")
        variants[name] = make(name, src, extra)
    torch.set_num_threads(2)
    if stack:
        bench_draft_stack(variants)
        return
    bench(variants, 4, 17920, 1536, 3)
    bench(variants, 8, 17920, 1536, 2)
    bench(variants, 4, 1536, 8960, 6)
    bench(variants, 8, 1536, 8960, 3)


if __name__ == "__main__":
    main()
