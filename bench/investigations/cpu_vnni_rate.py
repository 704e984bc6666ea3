"""What one core's AVX-512 VNNI does per second: 512-bit and 256-bit vpdpbusd, twelve
independent accumulators (throughput) and one chained (latency), in a small C loop compiled
here. The quantized matmul (specdec/cpu_kernels/quant_matmul.c, `block_avx`) spends 8 of them
on each activation row of a 16 x 32 weight unit, so at several rows (a verification) this is
its compute floor: 8 x the 512-bit time per row per unit, against the 3.7-5.2 ns a further row
measured in cache (bench/results/HISTORY.md, 2026-12-06, `cpu_matmul_roofline.py`).

    PYTHONPATH=. python3 bench/investigations/cpu_vnni_rate.py
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from specdec.cpu_kernels import build

SOURCE = r"""
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define Z(i) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #i "\n\t"
#define Y(i) "vpdpbusd %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define REGS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
             "xmm9", "xmm10", "xmm11"
int main(void) {
    const long n = 50000000;
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int rep = 0; rep < 3; rep++) {
        double t = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile(Z(0) Z(1) Z(2) Z(3) Z(4) Z(5) Z(6) Z(7) Z(8) Z(9) Z(10) Z(11)
                             ::: REGS);
        double d = (now() - t) / n / 12 * 1e9;
        best[0] = d < best[0] ? d : best[0];
        t = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile(Y(0) Y(1) Y(2) Y(3) Y(4) Y(5) Y(6) Y(7) Y(8) Y(9) Y(10) Y(11)
                             ::: REGS);
        d = (now() - t) / n / 12 * 1e9;
        best[1] = d < best[1] ? d : best[1];
        t = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile(Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0)
                             ::: "xmm0");
        d = (now() - t) / n / 12 * 1e9;
        best[2] = d < best[2] ? d : best[2];
        unsigned long v = 0;
        t = now();
        for (long i = 0; i < 4 * n; i++) __asm__ volatile("add $1, %0" : "+r"(v));
        d = (now() - t) / (4 * n) * 1e9;
        best[3] = d < best[3] ? d : best[3];
    }
    printf("512-bit vpdpbusd, 12 independent: %.3f ns each\n", best[0]);
    printf("256-bit vpdpbusd, 12 independent: %.3f ns each\n", best[1]);
    printf("512-bit vpdpbusd, one chain: %.3f ns each (latency)\n", best[2]);
    printf("a chained add (about a cycle with its loop): %.3f ns, %.2f GHz\n", best[3],
           1.0 / best[3]);
    printf("floor of a further activation row per 16 x 32 unit (8 x 512-bit): %.2f ns\n",
           8 * best[0]);
    return 0;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "vnni.c", Path(tmp) / "vnni"
        src.write_text(SOURCE)
        subprocess.run([build._compiler(), "-O2", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout,
              end="")


if __name__ == "__main__":
    main()
