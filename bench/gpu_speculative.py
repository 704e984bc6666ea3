"""Speculative speedup at controlled acceptance on one GPU (bench/gpu_engine.py runs it): the
replay drafter proposes the target's own recorded output, corrupted at the rate that sets tau;
chains run overlapped (drafted on the device, specdec/chaining.py) and host-drafted, trees
overlapped, each against plain decoding of the same batch and the ideal tau / cost; then prompt
lookup chains drafted on the device and on the host (`lookup_cells`).
`run_requests` also times plain decoding for the other GPU scripts.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from gpu_host_profile import host_profile
from gpu_setup import CTX, log


class Run(NamedTuple):
    outputs: list[list[int]]  # token ids per prompt
    rate: float  # decode tokens/s once every request has its first token, to the end
    steady_rate: float  # the same while every request runs (until the first one finishes)
    tau: float  # tokens per verification step


def run_requests(engine, prompts, spec: dict, max_tokens: int, tag: str,
                 temperature: float = 0.0) -> Run:
    """Greedy requests, all added at once. `steady_rate` leaves out the tail in which requests
    that are done leave the batch (speculative requests finish at different steps): it is the
    rate of the batch size asked for, the one the ideal tau / cost describes."""
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                            max_tokens=max_tokens, ignore_eos=True, speculative=spec, seed=0)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final, started, t0, base = {}, set(), None, 0
    steady = None
    emitted = steps = 0

    def produced() -> int:
        return (sum(len(r.seq.output_token_ids) for r in engine.requests.values())
                + sum(len(o.token_ids) for o in final.values()))

    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            started.add(out.request_id)
            if out.finished:
                final[out.request_id] = out
        if t0 is not None and steady is None and any(o.finished for o in outs):
            # Up to the outputs just returned, the finishing ones included.
            torch.cuda.synchronize()
            steady = (produced() - base) / (time.perf_counter() - t0)
        if t0 is None and len(started) == len(ids):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base = produced()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    outs = [final[r].token_ids for r in ids]
    for r in ids:
        if final[r].spec is not None:
            emitted += final[r].spec.emitted_tokens
            steps += final[r].spec.steps
    rate = (sum(len(o) for o in outs) - base) / dt
    return Run(outs, rate, steady or rate, emitted / steps if steps else 1.0)


def cost_at(costs: dict, rows: int) -> float | None:
    """The cost ratio of the curve's bucket that holds `rows` query rows per sequence."""
    return costs.get(str(next(n for n in (2, 4, 8, 16, 32, 64) if n >= rows)))


def timed_cell(engine, prompts, spec: dict, max_tokens: int, tag: str, piped: bool,
               plain: Run, want: list[list[int]], cost: float | None) -> tuple[Run, dict]:
    """One speculative run, overlapped (`piped`, where overlap is on) or drafted on the host,
    against plain decoding of the same batch and the ideal tau / cost."""
    default = engine.config.runtime
    engine.use_runtime(replace(default, spec_overlap=piped))
    chained = engine.chainer.chained_steps
    try:
        run = run_requests(engine, prompts, spec, max_tokens, tag)
    finally:
        engine.use_runtime(default)
    cell = {"tau_measured": run.tau,
            "overlapped_steps": engine.chainer.chained_steps - chained,
            "output_equals_plain": run.outputs == want,
            "tokens_per_s": run.rate, "speedup": run.rate / plain.rate,
            "steady_tokens_per_s": run.steady_rate,
            "steady_speedup": run.steady_rate / plain.steady_rate}
    if cost:
        cell.update(cost_ratio=cost, ideal=run.tau / cost,
                    of_ideal=cell["speedup"] * cost / run.tau,
                    steady_of_ideal=cell["steady_speedup"] * cost / run.tau)
    return run, cell


def lookup_cells(engine, prompts, plain: Run, costs: dict, k: int, max_tokens: int, row: dict,
                 batch: int) -> None:
    """Prompt lookup chains of k (the n-gram drafter with `on_device`), drafted on the device in
    overlapped steps ("lookup") and on the host between steps ("lookup_host"). The greedy-stable
    model repeats its last token, so lookups hit from the first step: this is lookup's best
    case, tau near k + 1, where the host's drafting gap weighs most."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "on_device": True}
    cost = cost_at(costs, k + 1)
    run_requests(engine, prompts, spec, 16, f"warmlookup{batch}")
    for name, piped in (("lookup", True), ("lookup_host", False)):
        run, cell = timed_cell(engine, prompts, spec, max_tokens, f"{name}{batch}", piped,
                               plain, plain.outputs, cost)
        row[name] = cell
        log(f"batch {batch} {name}: tau {run.tau:.2f}, {run.rate:.1f} tok/s, speedup "
            f"{cell['speedup']:.2f} (steady {cell['steady_speedup']:.2f})"
            + (f", {cell['of_ideal']:.0%} / {cell['steady_of_ideal']:.0%} of ideal"
               if cost else "") + f", output equals plain: {cell['output_equals_plain']}")


@torch.no_grad()
def make_greedy_stable(model) -> None:
    """Scale the embedding up and point the head at it: the model then predicts its input token
    by a wide margin, so bf16 rounding (which differs between pass shapes) never flips a greedy
    choice and a recorded script stays the target's output. Shapes and bytes are unchanged."""
    emb = model.model.embed_tokens.weight
    emb.mul_(1000.0)
    model.lm_head.weight.copy_(emb / 1000.0)


def speculative(engine, res: dict, batches, taus, k: int, tree_branches: int,
                max_tokens: int, profile_dir: Path | None = None) -> None:
    from drafters import replay

    make_greedy_stable(engine.runner.model)
    if engine.runner.graphs is not None:
        # Every bucket the runs below may meet, up front (as the server does at start): no
        # capture or tile tuning falls inside a timed window.
        t = time.monotonic()
        n = engine.runner.graphs.capture_all(max(batches), 16)
        res["graph_capture_all_s"] = time.monotonic() - t
        log(f"captured {n} more graphs in {res['graph_capture_all_s']:.1f} s")
    res["speculative_note"] = ("random weights with the embedding scaled x1000 and the head set "
                               "to it, so greedy outputs are stable under bf16 rounding and the "
                               "replayed script stays valid (tau follows the corrupt rate)")
    res["speculative_max_tokens"] = max_tokens

    g = torch.Generator().manual_seed(1)
    vocab = engine.runner.vocab_size
    default_runtime = engine.config.runtime
    out = {}
    for batch in batches:
        low = min(100, vocab // 2)
        prompts = [torch.randint(low, vocab, (CTX,), generator=g).tolist() for _ in range(batch)]
        # Untimed: the first steps at a new batch size capture graphs and tune kernel tiles.
        run_requests(engine, prompts, {"method": "none"}, 8, f"warmplain{batch}")
        plain = run_requests(engine, prompts, {"method": "none"}, max_tokens, f"plain{batch}")
        plain_rate = plain.rate
        row = {"plain_tokens_per_s": plain_rate, "plain_steady_tokens_per_s": plain.steady_rate}
        log(f"batch {batch} plain: {plain_rate:.1f} tok/s (steady {plain.steady_rate:.1f})")
        costs = res.get("verify_cost_ratio", {}).get(str(batch), {})
        for shape, branches in (("chain", 1), ("tree", tree_branches)):
            base = {"method": "replay", "num_speculative_tokens": k, "branches": branches}
            # Record with every proposal rejected: the same tree shape as the replayed runs.
            replay.clear_recorded()
            rec = run_requests(engine, prompts, {**base, "corrupt_rate": 1.0}, max_tokens,
                               f"rec{batch}{shape}")
            for p, o in zip(prompts, rec.outputs):
                replay.record(p, o)
            row[f"{shape}_tau1_tokens_per_s"] = rec.rate
            rows = 1 + k * branches  # query rows per sequence: its bucket in the cost curve
            cost = cost_at(costs, rows)
            # Untimed: captures the graphs of the smaller batches that appear as requests
            # finish at different steps, and meets every kernel the accepted paths use (at
            # batch 1 the first KV compaction of a side branch fell inside the timed tau-2
            # tree run on 2026-12-01: 26% and 63% of ideal), so no capture, compile or
            # kernel load falls inside a timed run.
            run_requests(engine, prompts, {**base, "corrupt_rate": replay.rate_for_tau(
                taus[0], k)}, max_tokens, f"warm{batch}{shape}")
            # Chains run twice: drafted on the device with each step launched before the last
            # one's verdict is read back (specdec/chaining.py, the engine's default with
            # overlap on), then drafted on the host between steps, as a host drafter (n-gram)
            # is ("_host" cells).
            modes = ((shape, True), (f"{shape}_host", False)) if branches == 1 else (
                (shape, True),)
            for (name, piped), tau in ((m, t) for m in modes for t in taus):
                rate = replay.rate_for_tau(tau, k)
                run, cell = timed_cell(engine, prompts, {**base, "corrupt_rate": rate},
                                       max_tokens, f"s{batch}{name}{tau}", piped, plain,
                                       rec.outputs, cost)
                row[f"{name}_tau{tau}"] = cell = {"corrupt_rate": rate, **cell}
                log(f"batch {batch} {name} tau {tau}: measured tau {run.tau:.2f}, "
                    f"{run.rate:.1f} tok/s, speedup {cell['speedup']:.2f} "
                    f"(steady {cell['steady_speedup']:.2f})"
                    + (f", {cell['of_ideal']:.0%} / {cell['steady_of_ideal']:.0%} of ideal"
                       if cost else ""))
        lookup_cells(engine, prompts, plain, costs, k, max_tokens, row, batch)
        out[str(batch)] = row
        res["speculative"] = out
        if batch > 1 and profile_dir is not None:
            base = {"method": "replay", "num_speculative_tokens": k, "branches": 1,
                    "corrupt_rate": replay.rate_for_tau(3, k)}
            # Of host-drafted steps (the overlapped ones leave the host no gap to profile).
            engine.use_runtime(replace(default_runtime, spec_overlap=False))
            try:  # a diagnostic: its failure must not cost the run's measurements
                res[f"host_profile_b{batch}"] = host_profile(
                    engine, prompts, base, max_tokens, profile_dir / f"host_profile_b{batch}.txt")
            except Exception as e:
                log(f"host profile failed: {e!r}")
                res[f"host_profile_b{batch}"] = {"error": repr(e)}
            finally:
                engine.use_runtime(default_runtime)
    res["speculative"] = out
