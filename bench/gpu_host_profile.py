"""Where a speculative step's host time goes on the GPU machine (bench/gpu_engine.py runs it
after the batch-16 speculative runs and stores the result as `host_profile_b16`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from gpu_setup import log


def wrap_timed(obj, name: str, key: str, acc: dict[str, float]):
    """obj.name, timed: each call's seconds added to acc[key]. Returns the original."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
    setattr(obj, name, timed)
    return fn


def host_profile(engine, prompts, spec: dict, max_tokens: int, path: Path) -> dict:
    """Where a speculative step's host time goes, once every request has its first token
    (untimed run): per step, milliseconds in each engine phase, then a cProfile of the same
    steps in `path`. The read-back is waiting for the device plus the verdict on host lists; a
    read-back near zero means the device waited for the host."""
    import cProfile
    import io
    import pstats

    import specdec.cuda_graphs as cg
    import specdec.engine as E
    from specdec.sampling_params import SamplingParams
    from specdec.verdict import Verdict

    acc: dict[str, float] = {}
    patched = []

    def wrap(obj, name: str, key: str) -> None:
        patched.append((obj, name, wrap_timed(obj, name, key, acc)))

    wrap(Verdict, "read", "read_back")
    # The device's idle gap: from a verdict's read-back to the next pass's replay.
    read_end = [None]
    read, replay = Verdict.read, torch.cuda.CUDAGraph.replay

    def read_marked(*a, **kw):
        try:
            return read(*a, **kw)
        finally:
            read_end[0] = time.perf_counter()

    def replay_marked(self):
        if read_end[0] is not None:
            key = "device idle (read-back to replay)"
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - read_end[0]
            read_end[0] = None
        return replay(self)
    patched += [(Verdict, "read", read), (torch.cuda.CUDAGraph, "replay", replay)]
    Verdict.read, torch.cuda.CUDAGraph.replay = read_marked, replay_marked
    wrap(engine.committer, "commit", "commit (incl. read_back)")
    wrap(engine.outputs, "build", "outputs (deferred)")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.drafting, "propose", "propose")
    wrap(engine.runner, "execute", "execute (pack, copy, replay, logits)")
    wrap(E, "verify_step", "verify_step")
    wrap(engine.chainer, "chain", "chain (stage, execute, device verdict)")
    wrap(cg, "pack_step", "pack_step (in execute)")
    wrap(torch.cuda.CUDAGraph, "replay", "graph.replay (in execute)")
    # The rest of the idle gap: the segments are run - execute - verify_step.
    wrap(engine, "_launch", "launch (segments, execute, verify_step)")
    wrap(engine.drafting, "depths", "choose_depths")
    wrap(cg, "pick_bucket", "pick_bucket (in execute)")
    if engine.runner.graphs is not None:
        wrap(engine.runner.graphs, "_stage", "stage (pack, copy; in execute)")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            speculative=spec)
    ids = [f"prof-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    acc.clear()
    prof = cProfile.Profile()
    steps, t = 0, time.perf_counter()
    half = None
    try:
        while engine.has_unfinished():
            if steps == 30:  # the first 30 steps timed plainly, the rest under cProfile
                half = (steps, time.perf_counter() - t, dict(acc))
                prof.enable()
            engine.step()
            steps += 1
    finally:
        prof.disable()
        for obj, name, fn in reversed(patched):  # the last wrapper first
            setattr(obj, name, fn)
    buf = io.StringIO()
    if half is None:  # too few steps: all of them timed plainly, none profiled
        half = (steps, time.perf_counter() - t, dict(acc))
        buf.write(f"only {steps} steps: none profiled\n")
    else:
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumtime").print_stats(45)
    path.write_text(buf.getvalue())
    n, wall, phases = half
    res = {"steps_timed": n, "wall_ms_per_step": wall / n * 1e3,
           "phase_ms_per_step": {k: v / n * 1e3 for k, v in phases.items()}, "spec": spec,
           "note": "decode steps only, without the profiler; read-back = waiting for the device "
                   "+ the verdict on host lists; the cProfile of the later steps is in " +
                   path.name}
    log(f"host profile: {res}")
    return res
