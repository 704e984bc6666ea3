"""Compile quant_matmul.c on first use and load it through ctypes.

Three builds of the same source: `avx512` (AVX-512 F/BW/VL with VNNI, where /proc/cpuinfo reports
them), `avx2` (AVX2 with FMA and F16C: most laptops without AVX-512) and `portable` (plain C,
vectorised by the compiler for this machine). They offer four paths through the matmul:
"portable", "avx2", "avx512" and "amx" (the avx512 build's AMX tiles, where the CPU has them and
the kernel grants them). All four give identical results; `choose_path`
times each on a layer-sized matmul at the row count asked for (once per bucket of row counts)
and keeps the fastest, so the choice follows this CPU, not a guess. The shared objects live in
the cache (`$SPECDEC_CACHE/kernels`), keyed by the source, the flags and the CPU's flags: a fresh
machine compiles them once (a few seconds with gcc).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

# The matmuls and attention, and the decoder layers built on them (specdec/models/cpu_layers.py).
SOURCES = (Path(__file__).with_name("quant_matmul.c"), Path(__file__).with_name("layer_step.c"))
# Part of the cache key too.
HEADERS = (Path(__file__).with_name("fixed_math.h"), Path(__file__).with_name("quant_matmul.h"))
BUILDS = ("avx512", "avx2", "portable")
# the `path` argument of sd_q*_matmul (0: the portable loop, 1: the build's vector kernel, 2: AMX)
PATHS = {"portable": 0, "avx2": 1, "avx512": 1, "amx": 2}
_BUILD = {"portable": "portable", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}
_FLAGS = {
    "avx512": ["-DSD_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma",
               "-mf16c"],
    "avx2": ["-DSD_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "portable": ["-march=native"],
}
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
          "avx2": {"avx2", "fma", "f16c"}, "portable": set()}


class KernelUnavailable(RuntimeError):
    """This machine cannot build or run the requested kernel build."""


@cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelUnavailable("no C compiler (gcc or cc) on PATH to build the quantized "
                                "CPU kernels; install one (apt-get install gcc) or load with "
                                "quantization='none'")
    return cc


def _cache_dir() -> Path:
    from specdec.hub.resolve import cache_root

    return cache_root() / "kernels"


def _argtypes(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sd_quantize_rows.argtypes = [p, i64, i64, p, p, p]
    lib.sd_quantize_rows.restype = None
    for name in ("sd_q4_matmul", "sd_q5_matmul", "sd_q8_matmul"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, i64, i64, p, p, p, p, i64, p, i64, ctypes.c_int]
        fn.restype = None
    lib.sd_attention.argtypes = [p, i64, i64, i64, i64, p, p, p, i64, i64, p, p, p, p,
                                 ctypes.c_float, p]
    lib.sd_attention.restype = None
    lib.sd_amx_enable.restype = ctypes.c_int
    lib.sd_layers.argtypes = [p, i64, p, p]  # layer records, count, residual, step record
    lib.sd_layers.restype = ctypes.c_int
    return lib


@cache
def load(isa: str) -> ctypes.CDLL:
    """The compiled build `isa`, compiled now if the cache lacks it."""
    if isa not in BUILDS:
        raise ValueError(f"cpu kernel build must be one of {BUILDS}, got {isa!r}")
    if not _NEEDS[isa] <= cpu_flags():
        raise KernelUnavailable(f"this CPU lacks {sorted(_NEEDS[isa] - cpu_flags())} "
                                f"for the {isa} kernels")
    cc = _compiler()
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", *_FLAGS[isa]]
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)
                         + " ".join([cc, *flags]).encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    out = _cache_dir() / f"quant_matmul-{isa}-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        try:
            run = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                                 capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise KernelUnavailable(f"building the {isa} CPU kernels failed:\n{run.stderr}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)
    # torch is imported first, so the OpenMP runtime the library links (libgomp.so.1) is the
    # one torch already loaded: one thread pool, sized by torch.set_num_threads.
    return _argtypes(ctypes.CDLL(str(out)))


def library(path: str) -> ctypes.CDLL:
    """The build that runs `path`; KernelUnavailable where this machine cannot run it."""
    if path not in PATHS:
        raise ValueError(f"cpu kernel path must be one of {sorted(PATHS)} or 'auto', got "
                         f"{path!r}")
    lib = load(_BUILD[path])
    if path == "amx" and not lib.sd_amx_enable():
        raise KernelUnavailable("this CPU or kernel offers no AMX tiles (AMX-TILE, AMX-INT8 and "
                                "Linux >= 5.16 are needed)")
    return lib


def available_paths() -> list[str]:
    out = []
    for path in PATHS:
        try:
            library(path)
            out.append(path)
        except KernelUnavailable:
            pass
    return out


def _bucket(rows: int) -> int:
    return min(16, 1 << max(0, (rows - 1).bit_length()))


def _time_paths(paths: list[str], rows: int, rounds: int = 5) -> dict[str, float]:
    """Seconds for `rows` activation rows through 24 random q4 layers of a decode size (2048 x
    1536; 24 copies overflow the last-level cache), per path: the fastest of `rounds` passes,
    the paths taking turns within each round, so that a burst of other work on the machine (a
    second server loading) cannot make one path look faster than it is. Any bytes are valid q4
    values."""
    gen = torch.Generator().manual_seed(0)
    n, k = 2048, 1536
    units = (n // 16) * (k // 32)
    ws = [(torch.randint(0, 256, (units * 256,), dtype=torch.uint8, generator=gen),
           (torch.rand(units * 16, generator=gen) * 0.01).half()) for _ in range(24)]
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen)
    xd, xs = torch.rand(rows, k // 32, generator=gen), torch.rand(rows, k // 32, generator=gen)
    y = torch.empty(rows, n)

    def run(path: str, qs: torch.Tensor, d: torch.Tensor) -> None:
        library(path).sd_q4_matmul(xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), rows, k,
                                   qs.data_ptr(), d.data_ptr(), d.data_ptr(), None, n,
                                   y.data_ptr(), n, PATHS[path])

    best = dict.fromkeys(paths, float("inf"))
    for p in paths:
        run(p, *ws[0])
    for i in range(rounds):
        for p in paths:
            t = time.perf_counter()
            for w in ws:
                run(p, *w)
            best[p] = min(best[p], time.perf_counter() - t)
        # After one round, a path twice as slow as the fastest cannot win: the portable one's
        # later rounds took 5.8 of the 8.0 s that timing 5 buckets cost on the 2-core CPU.
        if i == 0:
            paths = [p for p in paths if best[p] <= 2 * min(best.values())]
    return best


_CHOSEN: dict[int, str] = {}  # row bucket -> the path measured fastest for it


def choose_path(rows: int) -> str:
    """The fastest path this CPU runs for `rows` activation rows, measured once per bucket
    (1, 2, 4, 8, 16 and more)."""
    bucket = _bucket(rows)
    if bucket not in _CHOSEN:
        paths = available_paths()
        if not paths:
            raise KernelUnavailable("no CPU kernel build is usable here (is a C compiler "
                                    "installed?)")
        times = _time_paths(paths, bucket) if len(paths) > 1 else {paths[0]: 0.0}
        _CHOSEN[bucket] = min(times, key=times.__getitem__)
    return _CHOSEN[bucket]


def choices() -> dict[int, str]:
    """What was measured and picked so far: row bucket -> path."""
    return dict(_CHOSEN)
