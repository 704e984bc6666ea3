"""What the speculation controller sees inside a running `specdec serve`: loaded by Python at
start (as `sitecustomize`) when this folder is on PYTHONPATH, it appends one JSON line per
decode request and step to $SD_TRACE: the depth chosen, the survival S_1 .. S_k the controller
estimated (and the draft model's reach D_1 .. D_k, where its `p_min` may stop it short), the
drafter's catch-up (seconds) and whether it was behind, the costs it planned with (the target
pass at 1-5 rows, a drafted step's extra, the draft model at depths 1-4 priced at that reach,
in ms) and the machine's pace they are priced at; and one line per model pass (`exec`: its
milliseconds, the model's vocabulary size telling target from draft). Servers started by a
benchmark inherit the environment:

    SD_TRACE=/tmp/trace.jsonl PYTHONPATH=bench/investigations/server_trace \\
        python bench/cpu_vs_llamacpp.py --engines specdec_plain,specdec_spec --prompts 6 \\
        --passes 1 --out /tmp/run.json

Without SD_TRACE it does nothing.
"""

import builtins
import json
import os
import time

_LOG = os.environ.get("SD_TRACE")


def _install(out) -> None:
    import specdec.drafting as drafting
    import specdec.model_runner as model_runner

    cls = drafting.Drafting
    depths = cls.depths

    def traced_depths(self, decoding):
        depths(self, decoding)
        costs = self.controller.costs
        for r in decoding:
            alt = self._alternative(r, self._choices(r)[0]) if r.spec.on else None
            out.write(json.dumps({
                "t": round(time.time(), 4), "ev": "depth", "rid": r.request_id[-6:],
                "depth": r.depth,
                "surv": [round(x, 3) for x in alt.survival] if alt else None,
                "catch_up_s": round(alt.catch_up, 4) if alt else None,
                "behind": alt.stale if alt else None,
                "pass_ms": [round(costs.pass_time(n) * 1e3, 2) for n in range(1, 6)],
                "spec_ms": round(costs.spec_time(1) * 1e3, 2),
                "pace": round(costs.speed, 3),
                "reach": [round(x, 3) for x in alt.reach] if alt and alt.reach else None,
                "draft_ms": [round(costs.draft.time("draft_model", 1, k, alt and alt.reach)
                                   * 1e3, 2) for k in range(1, 5)]}) + "\n")

    cls.depths = traced_depths
    execute = model_runner.ModelRunner.execute

    def traced_execute(self, *a, **kw):
        t = time.perf_counter()
        res = execute(self, *a, **kw)
        out.write(json.dumps({"ev": "exec", "vocab": self.mc.vocab_size,
                              "ms": round((time.perf_counter() - t) * 1e3, 2)}) + "\n")
        return res

    model_runner.ModelRunner.execute = traced_execute


if _LOG:
    _out = open(_LOG, "a", buffering=1)
    _import = builtins.__import__
    _done = []

    def _hook(name, *a, **kw):
        module = _import(name, *a, **kw)
        if not _done and name == "specdec.engine":
            _done.append(True)
            _install(_out)
        return module

    builtins.__import__ = _hook
