"""Verification steps on the GPU: the fused tree attention kernel (rotary + KV write + attention
over the context and the step's own rows, verify_kernels/tree_attention.py) against the
two-launch path it replaces (rope_write_kv, then the general paged attention), side by side.

1. Kernels alone: 32 layers' worth of attention for Q rows per sequence under a binary-tree
   mask (Llama-3.1-8B heads, 1k context, each layer on its own KV) in one CUDA graph, per
   layer, over split counts and warp counts.
2. The runner (Llama-3.1-8B shape, random weights, bf16): the batch-1 verification cost curve
   (time of a Q-row step over a 1-row decode step) under alternated settings (RUNNER_MODES:
   module switches of the kernels or fields of the model's FusedKernels, set before each
   mode's graphs are captured); then
   the GPU time of each kernel (and of each layer matmul) in 1-, 2-, 4- and 8-row steps under
   the last setting (torch.profiler).

    PYTHONPATH=. python3 bench/gpu_verify_attn.py --out DIR   (writes DIR/gpu_verify_attn.json)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_setup as gs
from gpu_decode_attn import BS, HKV, HQ, LAYERS, D, graph_us


def tree_case(bsz: int, rows: int, hq: int = HQ, hkv: int = HKV):
    """32 layers' inputs of a verification step: (qkv_of(layer) -> q, k, v; caches; positions;
    inverse frequencies; metadata; slots) for `bsz` sequences of `rows` rows under a binary-tree
    mask, each over a 1k context, with `hq` query and `hkv` KV heads (Llama-3.1-8B's unless
    given)."""
    from drafters.tree import ancestor_mask_of
    from specdec.attention_metadata import AttentionMetadata

    ctx = gs.CTX
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    per = -(-(ctx + rows) // BS)
    nb = bsz * per
    caches = [torch.randn(2, nb, BS, hkv, D, device="cuda", dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    t = bsz * rows
    qkv = [torch.randn(t, (hq + 2 * hkv) * D, device="cuda", dtype=torch.bfloat16)
           for _ in range(LAYERS)]
    i32 = {"dtype": torch.int32, "device": "cuda"}
    tables = torch.arange(nb, **i32).view(bsz, per)
    cols = ctx + torch.arange(rows, device="cuda")
    slots = (tables[:, cols // BS].long() * BS + cols % BS).flatten()
    parents = gs.tree_parents(rows - 1)
    mask = ancestor_mask_of(parents).flatten().to("cuda").repeat(bsz)
    meta = AttentionMetadata(
        torch.arange(0, t + 1, rows, **i32), torch.full((bsz,), ctx, **i32),
        torch.full((bsz,), ctx + rows, **i32), tables, slots, mask,
        torch.arange(0, bsz * rows * rows, rows * rows, device="cuda"), (rows,) * bsz,
        (ctx,) * bsz, tuple(range(0, bsz * rows * rows, rows * rows)), BS)
    pos = (ctx + torch.arange(rows, device="cuda")).repeat(bsz)

    def qkv_of(i):
        x = qkv[i]
        return (x[:, :hq * D].view(t, hq, D), x[:, hq * D:(hq + hkv) * D].view(t, hkv, D),
                x[:, (hq + hkv) * D:].view(t, hkv, D))

    return qkv_of, caches, pos, inv, meta, slots


def kernels_at(bsz: int, rows: int, out: list) -> None:
    from verify_kernels.fused_ops import rope_write_kv
    from verify_kernels.paged_attention import paged_attention
    from verify_kernels.tree_attention import tree_attention

    qkv_of, caches, pos, inv, meta, slots = tree_case(bsz, rows)
    for splits in (1, 4, 8, 16, 32):
        if bsz * HKV * splits > 8 * 132:
            continue

        def old(i, splits=splits):
            q, k, v = qkv_of(i)
            rope_write_kv(q, k, v, pos, inv, 1.0, caches[i][0], caches[i][1], slots)
            paged_attention(q, caches[i][0], caches[i][1], meta, 0.088, num_splits=splits)

        row = {"batch": bsz, "rows": rows, "splits": splits, "two_launch_us": graph_us(old)}
        for warps in (4, 8):
            row[f"fused_w{warps}_us"] = graph_us(
                lambda i, splits=splits, warps=warps: tree_attention(
                    *qkv_of(i), pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088,
                    num_splits=splits, num_warps=warps))
        out.append(row)
        gs.log(json.dumps(row))


def kernel_times(engine, segs, steps: int = 20) -> dict:
    """GPU microseconds per runner step by kernel name, and the step's span and busy time."""
    ev = gs.cuda_events(lambda: engine.runner.execute(segs), steps, warmup=3)
    if not ev:
        return {"error": "no CUDA events recorded"}
    by: dict = {}
    for e in ev:
        us, n = by.get(e.name[:70], (0.0, 0.0))
        by[e.name[:70]] = (us + (e.time_range.end - e.time_range.start) / steps, n + 1 / steps)
    span = (ev[-1].time_range.end - ev[0].time_range.start) / steps
    busy = sum(us for us, _ in by.values())
    skinny = [e for e in ev if e.name.startswith("_skinny_kernel")]
    per_step = len(skinny) // steps
    roles: dict = {}
    for i, e in enumerate(skinny):
        p = i % per_step
        role = SKINNY_ROLES[p % 4] if p < per_step - 1 else "lm_head"
        roles[role] = roles.get(role, 0.0) + (e.time_range.end - e.time_range.start) / steps
    return {"span_us": span, "busy_us": busy,
            "skinny_us_by_role": {k: round(v, 1) for k, v in roles.items()},
            "kernels": {k: {"us": round(us, 2), "count": round(n, 2)}
                        for k, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])}}


# name: {(module, attribute): value} set before the mode's graphs are captured: an attribute
# of verify_kernels.<module>, or with module "kernels" a field of the model's FusedKernels
# (specdec/models/llama.py), e.g. {("kernels", "pdl"): True}.
# Earlier runs: gpu_verify_attn_h200_20261130_emit.json (norm hand-off from 1 or 2 rows, tree
# kernel up to 4 or 8 rows), _swap.json (swapped-dot tiles), _split.json (split-K tiles),
# _xnative.json (dot tiles reading x in bf16 or through float32: the same);
# gpu_verify_attn_h200_20261201_tree8.json (the tree kernel up to 4 or 8 rows, its owner
# program alone: the same), _prefetch.json (KV tiles loaded one ahead and per-token rotary
# angles off and on: decode step 4.08 against 4.12-4.17 ms, 8-row step 4.66 against 4.62).
# With one mode, the curve is measured twice.
RUNNER_MODES: dict[str, dict] = {"as_built": {}}
SKINNY_ROLES = ("qkv", "o_proj", "gate_up", "down")  # per layer, in launch order; then LM head


def runner_ab(out: dict) -> None:
    """Batch-1 cost curve under each of RUNNER_MODES, alternated twice; then per-kernel GPU
    times under the last mode and the tiles it chose. (The LM head inside 2- to 8-row graphs
    measured no faster: gpu_verify_attn_h200_20261130_b.json; two launches instead of the tree
    kernel slower at 2 and 4 rows: _c.json.)"""
    import gc
    from dataclasses import replace

    tmp = Path(tempfile.mkdtemp())
    engine = gs.build_engine(gs.make_model_dir(tmp, "llama-3.1-8b-shape"), "triton",
                             num_blocks=2600)
    engine.runner.kv.normal_()
    runner = engine.runner
    model = runner.model
    res = []
    for mode in list(RUNNER_MODES) * 2:
        for (module, attr), value in RUNNER_MODES[mode].items():
            if module == "kernels":  # the same tile choices, with the field replaced
                model.kernels = replace(model.kernels, **{attr: value})
            else:
                setattr(importlib.import_module(f"verify_kernels.{module}"), attr, value)
        runner.graphs.graphs.clear()  # recaptured with this path
        runner.graphs.splits.clear()
        torch.cuda.synchronize()
        gc.collect()
        runner.graphs.pool = torch.cuda.graph_pool_handle()  # a fresh pool for the new graphs
        row: dict = {"mode": mode}
        base = gs.time_steps(engine, gs.step_segments(engine, 1, 1, gs.CTX), iters=40)
        row["decode_step_ms"] = base * 1e3
        for n in (2, 4, 8):
            t = gs.time_steps(engine, gs.step_segments(engine, 1, n, gs.CTX), iters=40)
            row[f"step_ms_{n}"] = t * 1e3
            row[f"cost_{n}"] = t / base
        row["splits"] = {str(k): v for k, v in runner.graphs.splits.items()}
        gs.log(json.dumps(row))
        res.append(row)
    out["runner_ab_b1"] = res
    out["skinny_configs_last_mode"] = {str(k): v
                                       for k, v in model.kernels.tiles.chosen_configs().items()}
    out["kernel_times_b1"] = {
        str(n): kernel_times(engine, gs.step_segments(engine, 1, n, gs.CTX))
        for n in (1, 2, 4, 8)}
    for n, kt in out["kernel_times_b1"].items():
        gs.log(f"rows {n}: span {kt.get('span_us', 0):.0f} us, busy {kt.get('busy_us', 0):.0f}: "
               + json.dumps(dict(list(kt.get("kernels", {}).items())[:12]))
               + " matmuls: " + json.dumps(kt.get("skinny_us_by_role")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    out = gs.run_info()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    dst = path / "gpu_verify_attn.json"
    if not args.skip_kernels:
        rows: list = []
        for bsz, rows_n in ((1, 2), (1, 8), (4, 4), (4, 8)):
            kernels_at(bsz, rows_n, rows)
        out["kernels_per_layer"] = rows
        dst.write_text(json.dumps(out, indent=1))
    runner_ab(out)
    dst.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
