"""Whether a quantized model decodes faster with its weights on 2 MB pages: in one process, the
same weights taking turns between the mapping the loader puts them in (advised MADV_HUGEPAGE,
specdec/models/huge_pages.py) and ordinary heap copies (4 KB pages), a plain greedy generation
of --tokens tokens per turn, --rounds rounds, each home first in every other round. Prints
and writes tok/s per home (all, median, best) and the process's AnonHugePages.

    PYTHONPATH=. python3 bench/investigations/cpu_huge_pages.py [--rounds 12] [--tokens 48] \
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out")
    a = ap.parse_args()

    from prompts import humaneval_texts

    from specdec import LLM, SamplingParams
    from specdec.models.cpu_layers import CpuLayers
    from specdec.models.quant_model import quant_weights

    llm = LLM(model=a.model, quantization="auto", speculative={"method": "none"})
    model = llm.engine.runner.model
    weights = quant_weights(model)
    fields = ("qs", "d", "mn")
    homes = {"huge": [tuple(getattr(w, f) for f in fields) for w in weights],
             "heap": [tuple(None if (t := getattr(w, f)) is None else t.clone() for f in fields)
                      for w in weights]}

    layers = {}  # the C decoder layers take the weights' pointers when built: one per home
    for home in homes:
        for w, ts in zip(weights, homes[home]):
            for f, t in zip(fields, ts):
                setattr(w, f, t)
        layers[home] = CpuLayers.of(model)

    def use(home: str) -> None:
        for w, ts in zip(weights, homes[home]):
            for f, t in zip(fields, ts):
                setattr(w, f, t)
        model.cpu_layers = layers[home]
    text = humaneval_texts(1)[0]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([text], params)
    rates: dict[str, list[float]] = {"huge": [], "heap": []}
    for r in range(a.rounds):
        for home in ("heap", "huge") if r % 2 == 0 else ("huge", "heap"):
            use(home)
            t = time.perf_counter()
            llm.generate([text], params)
            rates[home].append(a.tokens / (time.perf_counter() - t))
    anon = next((line.split()[1] for line in Path("/proc/self/smaps_rollup").read_text()
                 .splitlines() if line.startswith("AnonHugePages")), None)
    res = {"model": a.model, "tokens": a.tokens, "rounds": a.rounds, "anon_huge_kb": anon,
           "tok_s": {h: {"median": round(statistics.median(v), 2), "best": round(max(v), 2),
                         "all": [round(x, 2) for x in v]} for h, v in rates.items()}}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
