"""How close the CPU's quantized matmuls come to what memory delivers: the weight matmuls of a
whole decode step of each preset model (the target's and the draft's, with the block kinds their
GGUF files give them; specdec/models/gguf_weights.py), run back to back at 1, 2 and 5 activation
rows on random weights of those shapes, against a plain streaming read of 1 GiB by the same
threads (a small C loop, compiled like the kernels). Fastest of `--rounds` passes, the stacks
and the read taking turns.

    PYTHONPATH=. python3 bench/investigations/cpu_matmul_roofline.py --out FILE.json

Where a stack's GB/s at one row reaches the read's, a decode step's matmuls are bound by memory;
the time each further row adds is their compute (on AVX-512 VNNI, 8 vpdpbusd per 512 weights),
which the same kernels on a weight that stays in cache time alone.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_decode import machine_info

from specdec.cpu_kernels import build
from specdec.models.gguf_weights import DIRECT
from specdec.models.quant_linear import BITS

READ_C = r"""
#include <immintrin.h>
#include <stdint.h>
int64_t sd_read(const uint8_t *a, int64_t n) {  /* xor of every 64 bytes, 2 streams a thread */
    int64_t sink = 0;
#pragma omp parallel reduction(^ : sink)
    {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 128) {
            s0 = _mm512_xor_si512(s0, _mm512_load_si512(a + i));
            s1 = _mm512_xor_si512(s1, _mm512_load_si512(a + i + 64));
        }
        sink ^= _mm512_reduce_add_epi64(_mm512_xor_si512(s0, s1));
    }
    return sink;
}
"""

NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
         "ffn_up": "up", "ffn_down": "down", "output": "lm_head", "token_embd": "embed"}


def stack(gguf: Path, quantization: str, vocab: int | None) -> list[tuple[int, int, int]]:
    """(kind, n, k) of each weight matmul of one decode step, one per tensor as the C layers
    run them (specdec/models/quant_model.py: a fused layer's parts), rows padded to 16; the
    output layer over `vocab` rows (the draft's reduced vocabulary) or all, tied to the
    embedding where the file has no output tensor."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    layers: dict[int, dict[str, tuple[str, int, int]]] = {}
    glob: dict[str, tuple[str, int, int]] = {}
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)
        parts = t.name.split(".")
        if parts[0] == "blk":
            layers.setdefault(int(parts[1]), {})[NAMES[parts[2]]] = (t.tensor_type.name, n, k)
        elif parts[0] in NAMES:
            glob[NAMES[parts[0]]] = (t.tensor_type.name, n, k)

    def kind(qtype: str) -> int:
        q = {"int4": "q4", "int8": "q8"}.get(quantization, DIRECT.get(qtype, "q8"))
        return BITS[q]

    out = []
    for i in sorted(layers):
        lay = layers[i]
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            qtype, n, k = lay[name]
            out.append((kind(qtype), -(-n // 16) * 16, k))
    qtype, n, k = glob.get("lm_head", glob["embed"])
    out.append((kind(qtype), vocab or n, k))
    return out


def weights(shapes: list[tuple[int, int, int]], gen: torch.Generator) -> list[tuple]:
    ws = []
    for kind, n, k in shapes:
        units, ub = (n // 16) * (k // 32), {4: 256, 5: 320, 8: 512}[kind]
        qs = torch.randint(0, 256 if kind != 8 else 127, (units * ub,), dtype=torch.uint8,
                           generator=gen)
        d = (torch.rand(units * 16, generator=gen) * 0.01).half()
        ws.append((kind, n, k, qs, d, d if kind != 8 else None))
    return ws


def nbytes(ws: list[tuple]) -> int:
    return sum(qs.numel() + d.numel() * 2 * (2 if mn is not None else 1)
               for _, _, _, qs, d, mn in ws)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b.Q4_K_M.gguf")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--rows", default="1,2,5")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from drafters.draft_model import DRAFT_QUANTIZATION, DRAFT_VOCAB
    from specdec.hub.resolve import cache_root

    lib = build.library("avx512")
    path = build.PATHS["avx512"]
    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp, "read.c"), Path(tmp, "read.so")
        src.write_text(READ_C)
        subprocess.run([build._compiler(), "-O3", "-fPIC", "-shared", "-fopenmp", "-mavx512f",
                        str(src), "-o", str(so)], check=True)
        reader = ctypes.CDLL(str(so))
    reader.sd_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    reader.sd_read.restype = ctypes.c_int64
    buf = torch.ones(1 << 30, dtype=torch.uint8)
    base = buf.data_ptr()
    aligned = (base + 63) // 64 * 64
    read_n = (buf.numel() - (aligned - base)) // 128 * 128

    gguf = cache_root() / "gguf"
    gen = torch.Generator().manual_seed(0)
    stacks = {"target": weights(stack(gguf / args.target, "auto", None), gen),
              "draft": weights(stack(gguf / args.draft, DRAFT_QUANTIZATION, DRAFT_VOCAB), gen)}
    rows = [int(r) for r in args.rows.split(",")]
    kmax = max(k for ws in stacks.values() for _, _, k, *_ in ws)
    nmax = max(n for ws in stacks.values() for _, n, *_ in ws)
    xs = {r: (torch.randint(-127, 128, (r, kmax), dtype=torch.int8, generator=gen),
              torch.rand(r, kmax // 32, generator=gen) * 0.01,
              torch.rand(r, kmax // 32, generator=gen), torch.empty(r, nmax)) for r in rows}

    def run(ws: list[tuple], r: int) -> None:
        xq, xd, xsum, y = xs[r]
        for kind, n, k, qs, d, mn in ws:
            fn = getattr(lib, f"sd_q{kind}_matmul")
            fn(xq.data_ptr(), xd.data_ptr(), xsum.data_ptr(), r, k, qs.data_ptr(), d.data_ptr(),
               mn.data_ptr() if mn is not None else None, None, n, y.data_ptr(), n, path)

    best: dict[str, float] = {}

    def timed(key: str, fn) -> None:
        t = time.perf_counter()
        fn()
        best[key] = min(best.get(key, float("inf")), time.perf_counter() - t)

    for rnd in range(args.rounds):
        timed("read", lambda: reader.sd_read(aligned, read_n))
        for name, ws in (stacks.items() if rnd % 2 == 0 else reversed(stacks.items())):
            for r in rows:
                timed(f"{name} {r}", lambda ws=ws, r=r: run(ws, r))
    # Compute alone: one small weight (q4 and q8, 1024 x 1024: 0.5-1 MB, within the two cores'
    # L2 caches) through many calls; per 16 x 32 unit and core, the call overhead included.
    small = dict(zip((4, 8), weights([(4, 1024, 1024), (8, 1024, 1024)], gen)))
    calls = 200
    for _ in range(args.rounds):
        for kind, w in small.items():
            for r in rows:
                timed(f"cache q{kind} {r}", lambda w=w, r=r: [run([w], r) for _ in range(calls)])
    units = 1024 * 1024 // 512
    cache_ns = {f"q{kind}": {r: round(best[f"cache q{kind} {r}"] / calls / units
                                       * args.threads * 1e9, 2) for r in rows}
                for kind in small}
    read_gbs = read_n / best["read"] / 1e9
    result = {"what": "quantized matmul stacks of a decode step against a streaming read",
              "date": time.strftime("%Y-%m-%d"), "machine": machine_info(args.threads),
              "args": vars(args), "read_GB_s": round(read_gbs, 1),
              "in_cache_ns_per_unit_per_core": cache_ns, "stacks": {}}
    print(f"streaming read, {args.threads} threads: {read_gbs:.1f} GB/s")
    print(f"in cache, ns per 16 x 32 unit and core by rows: {cache_ns}")
    for name, ws in stacks.items():
        mb = nbytes(ws) / 1e6
        one = best[f"{name} 1"]
        entry = {"MB": round(mb, 1), "matmuls": len(ws), "ms": {}, "GB_s": {},
                 "ms_per_extra_row": {}}
        for r in rows:
            t = best[f"{name} {r}"]
            entry["ms"][r] = round(t * 1e3, 2)
            entry["GB_s"][r] = round(mb / 1e3 / t, 1)
            if r > 1:
                entry["ms_per_extra_row"][r] = round((t - one) * 1e3 / (r - 1), 2)
            print(f"{name}: {mb:.0f} MB in {len(ws)} matmuls, {r} row(s): {t * 1e3:.2f} ms "
                  f"({mb / 1e3 / t:.1f} GB/s, {mb / 1e3 / t / read_gbs:.0%} of the read)")
        result["stacks"][name] = entry
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
