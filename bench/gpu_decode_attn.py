"""Decode attention on the GPU: the fused decode kernel (rotary + KV write + attention,
verify_kernels/decode_attention.py) against the two-launch path it replaces (rope_write_kv, then
the general paged attention), side by side in the same run.

Also programmatic dependent launch on and off (verify_kernels/pdl.py: the model's
`kernels.pdl`); the kernels alone take it as SPECDEC_PDL says (off unless 1).

1. Kernels alone: 32 layers' worth of decode attention (Llama-3.1-8B heads, 1k context, each
   layer on its own KV) in one CUDA graph, per layer, at several batch sizes and split counts.
2. The whole decode step and the engine (Llama-3.1-8B shape, random weights, bf16) with the
   fused kernel off and on, alternated: graph step time, its part outside the graph (the LM
   head and what follows), and engine tokens/s against the roofline.

3. A torch.profiler timeline of steady batch-1 decoding: per-kernel GPU time and the idle
   gaps between kernels. `--timeline-only --model qwen2.5-7b-shape` runs this part alone on
   another shape (the Qwen shape decoded at 82% of its roofline against Llama's 86% until
   one-row matmuls got 2-column tiles), with timelines of the runner's batch-1 pass over 1 and
   8 rows (the cost curve's n = 8 step).

    PYTHONPATH=. python3 bench/gpu_decode_attn.py --out DIR   (writes DIR/gpu_decode_attn.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_setup as gs

from specdec.graph_tuning import replay_ms

HQ, HKV, D, BS, LAYERS = 32, 8, 128, 16, 32


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of `fn` (one layer) inside a graph of LAYERS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(LAYERS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            fn(i)
    for _ in range(2):
        g.replay()
    return replay_ms(g, reps) * 1e3 / LAYERS  # after a third untimed replay


def kernels_at(bsz: int, rows: list) -> None:
    from specdec.attention_metadata import AttentionMetadata
    from verify_kernels.decode_attention import decode_attention
    from verify_kernels.fused_ops import rope_write_kv
    from verify_kernels.paged_attention import paged_attention

    ctx = gs.CTX
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    per = -(-(ctx + 1) // BS)
    nb = bsz * per
    caches = [torch.randn(2, nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
              for _ in range(LAYERS)]  # [2, blocks, BS, Hkv, D] per layer
    qkv = [torch.randn(bsz, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
           for _ in range(LAYERS)]
    i32 = {"dtype": torch.int32, "device": "cuda"}
    tables = torch.arange(nb, **i32).view(bsz, per)
    slots = tables[:, ctx // BS].long() * BS + ctx % BS
    meta = AttentionMetadata(
        torch.arange(bsz + 1, **i32), torch.full((bsz,), ctx, **i32),
        torch.full((bsz,), ctx + 1, **i32), tables, slots, None,
        torch.full((bsz,), -1, device="cuda"), (1,) * bsz, (ctx,) * bsz, (-1,) * bsz, BS)
    pos = torch.full((bsz,), ctx, device="cuda")
    pdl = gs.bench_runtime().pdl

    def qkv_of(i):
        x = qkv[i]
        return (x[:, :HQ * D].view(bsz, HQ, D), x[:, HQ * D:(HQ + HKV) * D].view(bsz, HKV, D),
                x[:, (HQ + HKV) * D:].view(bsz, HKV, D))

    for splits in (1, 2, 4, 8, 16, 32, 64):
        if bsz * HKV * splits > 8 * 132 or (bsz >= 16 and splits > 4):
            continue

        def old(i, splits=splits):
            q, k, v = qkv_of(i)
            rope_write_kv(q, k, v, pos, inv, 1.0, caches[i][0], caches[i][1], slots)
            paged_attention(q, caches[i][0], caches[i][1], meta, 0.088, num_splits=splits)

        def new(i, splits=splits):
            q, k, v = qkv_of(i)
            decode_attention(q, k, v, pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088,
                             num_splits=splits, pdl=pdl)

        t_old, t_new = graph_us(old), graph_us(new)
        row = {"batch": bsz, "splits": splits, "two_launch_us": t_old, "fused_us": t_new}
        for bn, warps in ((64, 8), (32, 4), (32, 8)):  # tiles that do not spill registers
            row[f"fused_n{bn}_w{warps}_us"] = graph_us(
                lambda i, splits=splits, bn=bn, warps=warps: decode_attention(
                    *qkv_of(i), pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088,
                    num_splits=splits, block_n=bn, num_warps=warps, pdl=pdl))
        rows.append(row)
        gs.log(f"b{bsz} splits {splits}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_us")))


def kernels(out: dict) -> None:
    rows: list = []
    for bsz in (1, 4, 16):
        kernels_at(bsz, rows)
    out["kernels_per_layer"] = rows


def engine_ab(out: dict, bw: float, name: str = "llama-3.1-8b-shape",
              timeline_only: bool = False) -> None:
    from gpu_speculative import run_requests

    tmp = Path(tempfile.mkdtemp())
    engine = gs.build_engine(gs.make_model_dir(tmp, name), "triton", num_blocks=2600)
    engine.runner.kv.normal_()
    m = engine.runner.model
    floor = (gs.weight_bytes(m) + gs.kv_bytes(engine.config.model, gs.CTX)) / bw
    out["model"], out["roofline_ms"] = name, floor * 1e3
    runner = engine.runner
    backend = runner.backend
    prompt = torch.randint(100, runner.vocab_size, (gs.CTX,)).tolist()
    if timeline_only:
        out["engine_timeline_b1"] = timeline(engine, prompt)
        for rows in (1, 8):
            out[f"runner_step_timeline_b1_rows{rows}"] = step_timeline(engine, rows)
        return
    res = []
    kernels = m.kernels  # the model's fused-kernel settings, as built
    # mode: (the fused decode kernel, programmatic dependent launch)
    modes = {"fused_pdl": (True, True), "fused": (True, False), "two_launch": (False, False)}

    def set_mode(mode: str) -> None:
        backend.fused_decode, pdl = modes[mode]
        m.kernels = replace(kernels, pdl=pdl)  # the same tile choices: tiles stay as tuned

    for mode in list(modes) * 2:
        set_mode(mode)
        runner.graphs.graphs.clear()  # recaptured with this path (tiles stay as tuned)
        runner.graphs.splits.clear()
        row: dict = {"mode": mode}
        segs8 = gs.step_segments(engine, 1, 8, gs.CTX)
        row["step_ms_b1_rows8"] = gs.time_steps(engine, segs8, iters=40) * 1e3
        for bsz in (1, 16):
            segs = gs.step_segments(engine, bsz, 1, gs.CTX)
            row[f"step_ms_b{bsz}"] = gs.time_steps(engine, segs, iters=40) * 1e3
            graph, _ = runner.graphs.graphs[(bsz, 1)]
            row[f"graph_only_ms_b{bsz}"] = replay_ms(graph, reps=40)
        row["step_fraction_of_roofline_b1"] = floor * 1e3 / row["step_ms_b1"]
        r = run_requests(engine, [prompt], {"method": "none"}, 128, f"ab-{len(res)}")
        row["engine_b1_tokens_per_s"] = r.rate
        row["engine_b1_fraction_of_roofline"] = r.rate * floor
        r16 = run_requests(engine, [prompt] * 16, {"method": "none"}, 64, f"ab16-{len(res)}")
        row["engine_b16_tokens_per_s"] = r16.rate
        gs.log(json.dumps(row))
        res.append(row)
    out["engine_ab"] = res
    out["graph_splits"] = {str(k): v for k, v in runner.graphs.splits.items()}
    set_mode("fused_pdl")
    runner.graphs.graphs.clear()
    out["engine_timeline_b1"] = timeline(engine, prompt)


def timeline(engine, prompt: list[int], steps: int = 30) -> dict:
    """GPU activity of `steps` engine steps of plain batch-1 decoding, in steady state: kernel
    time against the span they cover, time outside graphs by kernel, and the largest idle gaps
    with the kernels on either side."""
    from specdec.sampling_params import SamplingParams

    engine.add_request("tl", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 60,
                                                         ignore_eos=True))
    ev = gs.cuda_events(engine.step, steps, warmup=30)
    while engine.has_unfinished():
        engine.step()
    if not ev:
        return {"error": "no CUDA events recorded"}
    span = ev[-1].time_range.end - ev[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    gaps = []
    for a, b in zip(ev, ev[1:]):
        g = b.time_range.start - a.time_range.end
        if g > 3:
            gaps.append((g, a.name[:60], b.name[:60]))
    gaps.sort(reverse=True)
    by_name: dict = {}
    for e in ev:
        k = e.name[:60]
        t, n = by_name.get(k, (0.0, 0))
        by_name[k] = (t + (e.time_range.end - e.time_range.start) / steps, n + 1 / steps)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    # One step in order (from one argmax to the next): each kernel or copy, its time and the
    # idle time before it, to see which of a layer's launches run below the bandwidth.
    marks = [i for i, e in enumerate(ev) if "argmax" in e.name or "_pick_kernel" in e.name]
    one = []
    if len(marks) >= 3:
        for a, b in zip(ev[marks[1]:marks[2]], ev[marks[1] + 1:marks[2] + 1]):
            one.append((b.name[:40], round(b.time_range.end - b.time_range.start, 2),
                        round(b.time_range.start - a.time_range.end, 2)))
    out = {"steps": steps, "span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
           "events_per_step": len(ev) / steps,
           "gaps_over_3us_per_step": sum(g for g, _, _ in gaps) / steps,
           "largest_gaps": gaps[:20],
           "kernels_us_per_step": {k: {"us": t, "count": n} for k, (t, n) in top},
           "one_step_in_order": one}
    gs.log(json.dumps({k: v for k, v in out.items()
                       if k not in ("kernels_us_per_step", "one_step_in_order")})[:1500])
    return out


def step_timeline(engine, rows: int, steps: int = 10) -> dict:
    """GPU activity of `steps` back-to-back runner passes at batch 1 over `rows` rows per
    sequence at the benchmark context (the verification cost curve's step): time per kernel
    name, and one pass in order (from one input copy to the next), each event's time and the
    idle time before it."""
    segs = gs.step_segments(engine, 1, rows, gs.CTX)
    ev = gs.cuda_events(lambda: engine.runner.execute(segs), steps, warmup=5)
    if not ev:
        return {"error": "no CUDA events recorded"}
    span = ev[-1].time_range.end - ev[0].time_range.start
    by_name: dict = {}
    for e in ev:
        t, n = by_name.get(e.name[:60], (0.0, 0))
        by_name[e.name[:60]] = (t + (e.time_range.end - e.time_range.start) / steps, n + 1)
    marks = [i for i, e in enumerate(ev) if "HtoD" in e.name]
    one = []
    if len(marks) >= 3:
        seg = ev[marks[1]:marks[2] + 1]
        for a, b in zip(seg, seg[1:]):
            one.append((b.name[:40], round(b.time_range.end - b.time_range.start, 2),
                        round(b.time_range.start - a.time_range.end, 2)))
    res = {"rows": rows, "span_us_per_step": span / steps,
           "kernels_us_per_step": {k: {"us": t, "count": n / steps}
                                   for k, (t, n) in sorted(by_name.items(),
                                                           key=lambda kv: -kv[1][0])},
           "one_step_in_order": one}
    gs.log(f"runner step b1 rows {rows}: {res['span_us_per_step']:.1f} us per step; "
           + ", ".join(f"{k[:30]} {v['us']:.1f}" for k, v in
                       list(res["kernels_us_per_step"].items())[:6]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--kernels-only", action="store_true")
    ap.add_argument("--timeline-only", action="store_true",
                    help="only the engine's batch-1 GPU timeline (no kernel or A/B parts)")
    ap.add_argument("--model", default="llama-3.1-8b-shape", help="the shape of parts 2 and 3")
    args = ap.parse_args()
    out = gs.run_info()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    bw = gs.copy_bandwidth()
    out["copy_bandwidth_bytes_per_s"] = bw
    if not (args.skip_kernels or args.timeline_only):
        kernels(out)
        (path / "gpu_decode_attn.json").write_text(json.dumps(out, indent=1))
        if args.kernels_only:
            return
    engine_ab(out, bw, args.model, args.timeline_only)
    (path / "gpu_decode_attn.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
