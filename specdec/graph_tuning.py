"""The choices a CUDA graph bucket fixes at capture (`cuda_graphs.GraphRunner`): its KV split
count and the tiles of its few-row matmuls, both re-timed in the whole captured step.

Tiles are first chosen per kernel, timed alone (cold, with no neighbours); a tile that wins
alone does not always win between the step's other kernels. So on a bucket's first capture the
split count is timed among a few counts below the heuristic's (`split_candidates`), then each
matmul's tiles are re-chosen by replaying the step with every candidate, one matmul at a time,
keeping a change only when the step gets faster (a few seconds per row count, once: buckets
with the same rows per step share the tiles). RuntimeConfig.tune_graphs=False (the CLIs'
SPECDEC_TUNE_GRAPHS=0) skips both.

The choices are kept on disk (`cache_file`: SPECDEC_CACHE, or ~/.cache/specdec, under tuning/)
per GPU, torch and Triton versions, model parameter shapes, block table, tuning context and
kernel sources; a later runner with the same key loads them and captures its buckets without
timing anything (a cold start with every bucket tuned takes minutes on an H200).
RuntimeConfig.tuning_cache=False (SPECDEC_TUNING_CACHE=0) turns this off (the benchmarks do:
each run tunes afresh).

Both are timed on a placeholder step (`tuning_segments`), never on the step that triggered the
capture: every sequence of the bucket present, each with RuntimeConfig.tune_context tokens of
context (SPECDEC_TUNE_CONTEXT, default 1024, capped by the model's length) in distinct cache
blocks, and nothing written to the cache. Attention time depends on the context, and the
fastest split count with it: timed on the first real step, or on empty placeholders as before,
the choice followed whatever context that step happened to have (with none, the fewest
splits, whose merge is cheapest, won buckets whose later steps read 1k tokens and more).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

Outputs = tuple[torch.Tensor, "torch.Tensor | None"]  # a graph's hidden states, logits


def tuning_segments(batch: int, q: int, width: int, block_size: int, num_blocks: int,
                    context: int) -> list[Any]:
    """`batch` segments of `q` rows, each over `context` cached tokens (at most what a width-W
    block table holds) in blocks of its own (wrapping round the pool when it is small): the
    reads of a real step at that context. Slots are -1, so the step writes no KV; the cache
    holds finite values everywhere, so the garbage it reads stays finite."""
    from specdec.step_inputs import Segment

    ctx = max(0, min(context, width * block_size - q))
    n = -(-(ctx + q) // block_size)
    return [Segment([0] * q, list(range(ctx, ctx + q)), [-1] * q, ctx,
                    [(i * n + j) % num_blocks for j in range(n)], logits_rows=tuple(range(q)))
            for i in range(batch)]


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def heuristic_splits(b: int, q: int, hq: int, hkv: int, sms: int, longest: int) -> int:
    """Split-KV partitions for `b` sequences of `q` rows before any timing, sized for the
    longest context a step may have."""
    gp = _pow2(hq // hkv)
    block_q = max(16, gp, min(64, _pow2(q * gp))) // gp
    programs = b * hkv
    if q > block_q or programs >= sms:
        return 1
    # The kernel spreads the step's actual context over the splits, so plenty of splits
    # cost little at short contexts and keep each program to about one tile at 1-2k.
    # Decode attention (one row) takes 32-column tiles from 16 splits up and aims at about
    # 4 programs per SM (bench/results/gpu_decode_attn_h200_20261130_tiles.json).
    per_sm, tile = (4, 32) if q == 1 else (2, 64)
    return max(1, min(-(-per_sm * sms // programs), longest // tile, 32))


def split_candidates(first: int, owner: bool = False) -> list[int]:
    """Split counts timed against the heuristic's `first`: the powers of two from first // 4 (or
    1) up to, not including, first (at batch 1 of Llama-3.1-8B heads on the H200, tree attention
    over 8 rows took 15.3 us per layer at 16 splits against 21.0 at the heuristic's 32).

    `owner`: the kernel's split 0 takes only the step's own columns (fused tree attention), so
    S splits share the cached columns among S - 1 programs; each power of two s is then also
    tried as s + 1, which gives every busy program the same number of tiles (at 8 rows over 1k
    tokens, 12.99 us per layer at 9 splits against 13.44 at 16 and 14.95 at 8;
    bench/results/gpu_tiles_h200_20261201_owner.json)."""
    s = 1 << max(0, (first // 4).bit_length() - 1)
    out = []
    while s < first:
        out.append(s)
        if owner and 2 <= s and s + 1 < first:
            out.append(s + 1)
        s *= 2
    return out


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 8) -> float:
    """Milliseconds per replay of `graph` (after one untimed replay)."""
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def tune_splits(runner: Any, lay: Any, graph: torch.cuda.CUDAGraph, outs: Outputs
                ) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """The bucket's graph at the fastest of its heuristic split count and `split_candidates`:
    the merge and uneven split lengths can cost more than the parallelism gains (H200: 3 splits
    at 16 sequences of 8 rows 11% slower than 2; bench/results/gpu_splits_h200_20261130.json)."""
    key = (lay.batch, lay.q)
    first = runner.num_splits(*key)
    best, kept = replay_ms(graph), first
    for s in split_candidates(first, runner.owner_split(*key)):
        runner.splits[key] = s
        runner.forward(lay)  # compiles this split count's kernels outside the capture
        g, o = runner.capture(lay)
        t = replay_ms(g)
        if t < best * 0.997:  # past replay noise
            best, kept, graph, outs = t, s, g, o
    runner.splits[key] = kept
    runner.tuned.setdefault(key, {})["splits"] = {"heuristic": first, "chosen": kept}
    return graph, outs


def tune_tiles(runner: Any, lay: Any, keys: list[tuple], graph: torch.cuda.CUDAGraph,
               outs: Outputs) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """The bucket's graph with each matmul key's tile re-chosen in the whole step (in the
    runner's `tiles`, the model's choices)."""
    tiles = runner.tiles
    first = best = replay_ms(graph)
    trials = 0
    for key in keys:
        kept = tiles.config_of(key)
        for cfg in tiles.candidates(key):
            if cfg == kept:
                continue
            tiles.set_config(key, cfg)
            g, o = runner.capture(lay)
            t = replay_ms(g)
            trials += 1
            if t < best * 0.997:  # past replay noise
                best, kept, graph, outs = t, cfg, g, o
        tiles.set_config(key, kept)
        runner.tuned_keys.add(key)
    runner.tuned.setdefault((lay.batch, lay.q), {}).update(
        {"step_ms_alone_tuned": first, "step_ms": best, "trials": trials})
    return graph, outs


# Sources whose change may change what the tuning would choose: the kernels, the capture and
# tuning code, the model's forward.
_SOURCES = ("verify_kernels", "specdec/cuda_graphs.py", "specdec/graph_tuning.py",
            "specdec/models/llama.py")


def _sources_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in _SOURCES:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_file(runner: Any, context: int) -> Path:
    """Where `runner`'s choices, tuned at `context` tokens, are kept. The name is a digest of
    everything the choices depend on."""
    import triton

    from specdec.hub.resolve import cache_root

    dev = runner.device
    key = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__, "triton": triton.__version__,
        "params": [(n, list(p.shape), str(p.dtype)) for n, p in runner.model.named_parameters()],
        "heads": [runner.hq, runner.hkv], "block_size": runner.block_size,
        "width": runner.width, "context": context, "sources": _sources_digest(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "tuning" / f"{digest}.json"


def _encode_key(key: tuple) -> list:
    return [str(x) if isinstance(x, torch.dtype) else x for x in key]


def _decode_key(raw: list) -> tuple:
    return tuple(getattr(torch, x.removeprefix("torch.")) if isinstance(x, str)
                 and x.startswith("torch.") else x for x in raw)


def save_choices(runner: Any, path: Path) -> None:
    """The runner's tuned buckets (split counts) and every matmul tile chosen so far."""
    tiles = runner.tiles
    data = {
        "buckets": [[b, q, runner.splits[(b, q)]] for (b, q) in sorted(runner.splits)
                    if (b, q) in runner.tuned],
        "tiles": [[_encode_key(k), list(cfg)]
                  for k, cfg in (tiles.chosen_configs() if tiles is not None else {}).items()],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


def load_choices(runner: Any, path: Path) -> set[tuple[int, int]]:
    """Applies the choices kept at `path` (split counts, tiles, marked tuned); returns the
    buckets they cover (captured without timing). An unreadable file is ignored."""
    try:
        data = json.loads(path.read_text())
        buckets = {(int(b), int(q)): int(s) for b, q, s in data["buckets"]}
        tiles = [(_decode_key(k), tuple(cfg)) for k, cfg in data["tiles"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    runner.splits.update(buckets)
    if runner.tiles is not None:
        for key, cfg in tiles:
            runner.tiles.set_config(key, cfg)
            runner.tuned_keys.add(key)
    return set(buckets)
