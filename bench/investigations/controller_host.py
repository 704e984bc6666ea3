"""Host time of the speculation controller's choice alone, per step, for a padding runner at
batch 16, 64 and 128: n-gram candidates at 8 deep, a plain step priced at 7.4 ms and a drafted
one 3 ms dearer, every draft rejected (so the choice settles plain, as for a drafter that does
not pay). No model, no engine: what `SpeculationController.choose` and its candidates cost the
host each step, the median of 200 steps.

    PYTHONPATH=. python3 bench/investigations/controller_host.py
"""

from __future__ import annotations

import statistics
import time

from specdec.depth_plan import Alternative, Candidate
from specdec.spec_control import SpeculationController


def main() -> None:
    for batch in (16, 64, 128):
        c = SpeculationController()
        c.uniform = True
        ids = [f"r{i}" for i in range(batch)]
        c.record_pass(batch, 0.0074, 0, False, batch, 1)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            cands = [Candidate(r, [Alternative("ngram", 8, 1, c.survival(r, "ngram", 8), True)])
                     for r in ids]
            k = max(ch.k for ch in c.choose(batch, 0, cands, batch).values())
            for r in ids:
                c.verified(r, "ngram", k, 0, 1)
            times.append(time.perf_counter() - t)
            c.record_pass(batch * (k + 1), 0.0074 + (0.003 if k else 0.0), batch if k else 0,
                          False, batch, k + 1)
        print(f"batch {batch}: {statistics.median(times) * 1e3:.3f} ms a step (median of 200)")


if __name__ == "__main__":
    main()
