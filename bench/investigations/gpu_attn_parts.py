"""Where a tree attention layer's time goes on the GPU: the kernel of verify_kernels/
tree_attention.py as built, and with one part of its work taken out at a time, each timed per
layer inside a CUDA graph of 32 layers (batch 1, binary-tree mask, 1k context; Llama-3.1-8B
heads at 2 and 8 rows, Qwen2.5-7B's at 8), at the split count, tile and row blocks the graph
runner picks there. A kernel that takes the step's rotary factors (`rope`) gets them made once
per 32 layers, as the model makes them once per step. The variants are text edits of the
kernel's source, loaded as modules of their own; their outputs are wrong by design, only their
times mean something:

- "owner idle": split 0 (the step's own columns) scores nothing and writes no KV;
- "owner only": the other splits (the cached columns) do nothing;
- "no rope": the query rows are not rotated;
- "no merge": the split partials are not merged.

`--source FILE` times another version of the kernel's module (say, an earlier commit's:
`git show REV:verify_kernels/tree_attention.py > FILE`) under the same edits.

    PYTHONPATH=. python3 bench/investigations/gpu_attn_parts.py --out DIR [--source FILE] \\
        [--tag NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers

import gpu_setup as gs
from gpu_decode_attn import HKV, HQ, graph_us

EDITS = {
    "as built": (),
    "owner idle": (("        if owner:  # the step's own columns",
                    "        if False:  # the step's own columns"),),
    "owner only": (("    idle = (lo >= hi) & (split != 0)", "    idle = split != 0"),),
    "no rope": (("        q = rotate(qa, qb, cos, sin).to(qa.dtype)", "        q = qa"),),
    "no merge": (("        merge_splits(out, part, lse)", "        pass"),),
}
# (rows, query heads, KV heads, splits, tile columns, row blocks): what in-graph tuning kept.
CASES = ((8, HQ, HKV, 9, 64, 1), (2, HQ, HKV, 9, 64, 1), (8, 28, 4, 9, 64, 2))


def load_variant(source: str, edits: tuple, name: str, path: Path):
    for old, new in edits:
        assert old in source, f"{name}: {old!r} not in the source"
        source = source.replace(old, new)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_case(mods: dict, rows: int, hq: int, hkv: int, splits: int, bn: int, rb: int) -> dict:
    """Per-layer microseconds of each variant module's tree_attention in one case."""
    from gpu_verify_attn import tree_case

    from verify_kernels.fused_ops import rope_table

    qkv_of, caches, pos, inv, meta, _ = tree_case(1, rows, hq, hkv)
    row = {}
    for name, mod in mods.items():
        step: dict = {}

        def call(i, fn=mod.tree_attention, step=step):
            kw = {}
            if "rope" in inspect.signature(fn).parameters:  # once a step, as in the model
                if i == 0:
                    step["rope"] = rope_table(pos, inv, 1.0)
                kw["rope"] = step["rope"]
            fn(*qkv_of(i), pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088,
               num_splits=splits, block_n=bn, row_blocks=rb, **kw)
        row[name] = round(graph_us(call), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", default="verify_kernels/tree_attention.py")
    ap.add_argument("--tag", default="", help="a suffix for the output file's name")
    args = ap.parse_args()

    out = gs.run_info()
    out["source"] = args.source
    source = Path(args.source).read_text()
    table = out.setdefault("us_per_layer", {})
    with tempfile.TemporaryDirectory() as tmp:
        mods = {name: load_variant(source, edits, name, Path(tmp) / f"tree_variant_{i}.py")
                for i, (name, edits) in enumerate(EDITS.items())}
        for rows, hq, hkv, splits, bn, rb in CASES:
            key = f"rows {rows}, {hq}/{hkv} heads, s{splits} n{bn} r{rb}"
            table[key] = row = time_case(mods, rows, hq, hkv, splits, bn, rb)
            gs.log(f"{key}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
            torch.cuda.empty_cache()
    dst = Path(args.out)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / f"gpu_attn_parts{args.tag}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
