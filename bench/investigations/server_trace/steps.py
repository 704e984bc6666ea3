"""A server trace (sitecustomize.py's $SD_TRACE) by step: each request's steps with the time
from its step's depth choice to the next one's, the model passes in between (the target's told
from the draft model's by their time, over or under --split ms; a pass over --big ms, a prompt
read, is left out of the medians and listed), and what remains (host work). Per request, then
per chosen depth: medians in ms.

    python bench/investigations/server_trace/steps.py TRACE.jsonl [--split 25] [--big 70]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--split", type=float, default=25.0)
    ap.add_argument("--big", type=float, default=70.0)
    a = ap.parse_args()
    steps, pend = [], None
    for line in open(a.trace):
        e = json.loads(line)
        if e["ev"] == "depth":
            if pend is not None and pend["rid"] == e["rid"]:
                pend["wall"] = (e["t"] - pend["t"]) * 1e3
                steps.append(pend)
            pend = {"rid": e["rid"], "depth": e["depth"], "t": e["t"], "ex": [],
                    "spec": e["surv"] is not None}
        elif pend is not None:
            pend["ex"].append(e["ms"])
    for s in steps:
        s["big"] = [m for m in s["ex"] if m > a.big]
        s["target"] = sum(m for m in s["ex"] if a.split < m <= a.big)
        s["draft"] = [m for m in s["ex"] if m <= a.split]
        s["other"] = s["wall"] - sum(s["ex"])
    order = list(dict.fromkeys(s["rid"] for s in steps))
    for rid in order:
        xs = [s for s in steps if s["rid"] == rid]
        depths = collections.Counter(s["depth"] for s in xs)
        print(f"{rid} {'spec' if xs[0]['spec'] else 'plain'}: {len(xs)} steps, "
              f"{sum(s['wall'] for s in xs) / 1e3:.2f} s, target "
              f"{sum(s['target'] for s in xs) / 1e3:.2f} s, draft "
              f"{sum(sum(s['draft']) for s in xs) / 1e3:.2f} s "
              f"({sum(len(s['draft']) for s in xs)} passes), prompt reads "
              f"{[round(m) for s in xs for m in s['big']]} ms, "
              f"depths {dict(sorted(depths.items()))}")
    print("by depth (medians, ms; steps without a prompt read):")
    for d in sorted({s["depth"] for s in steps}):
        xs = [s for s in steps if s["depth"] == d and not s["big"]]
        if not xs:
            continue

        med = {k: statistics.median(f(s) for s in xs) for k, f in (
            ("wall", lambda s: s["wall"]), ("target", lambda s: s["target"]),
            ("draft", lambda s: sum(s["draft"])), ("passes", lambda s: len(s["draft"])),
            ("other", lambda s: s["other"]))}
        print(f"  depth {d}: {len(xs)} steps, wall {med['wall']:.1f}, target "
              f"{med['target']:.1f}, draft {med['draft']:.1f} ({med['passes']:.0f} passes), "
              f"other {med['other']:.1f}")


if __name__ == "__main__":
    main()
