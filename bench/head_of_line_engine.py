"""Head-of-line blocking at the engine, without the server: short FIM requests arriving once a
second, every `--long-every`-th one padded to `--long-chars` characters (bench/load_gen.py's
prompts), stepped as the server's engine loop steps them. Prints and saves each request's time
to first token. Run it once per source tree to compare scheduling policies:

    PYTHONPATH=OLD_TREE python bench/head_of_line_engine.py --out old.json
    python bench/head_of_line_engine.py --out new.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load_gen

from specdec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--long-chars", type=int, default=16000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prompts = load_gen.with_long_prompts(load_gen.fim_prompts(a.num_requests, random.Random(0)),
                                         a.long_every, a.long_chars)
    eng = LLM(model=a.model, speculative={"method": "none"}).engine
    ids = [eng.tokenizer.encode(f"<|fim_prefix|>{p.text}<|fim_suffix|>{p.suffix}<|fim_middle|>")
           for p in prompts]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    arrive: dict[str, float] = {}
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    nxt = steps = 0
    while nxt < len(ids) or eng.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(ids) and nxt / a.rate <= now:
            eng.add_request(str(nxt), ids[nxt], params)
            arrive[str(nxt)] = now
            nxt += 1
        if not eng.has_unfinished():
            time.sleep(0.005)
            continue
        for o in eng.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
        steps += 1
    ttft = {r: first[r] - arrive[r] for r in first}
    short = sorted(v for r, v in ttft.items() if not prompts[int(r)].long)
    long = sorted(v for r, v in ttft.items() if prompts[int(r)].long)
    tree = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                          text=True, cwd=Path(sys.modules["specdec"].__file__).parent).stdout
    res = {"what": "engine-level TTFT of short requests behind long prompts",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": tree.strip(),
           "args": vars(a), "prompt_tokens": [len(i) for i in ids], "steps": steps,
           "duration_s": round(time.perf_counter() - t0, 2),
           "short_ttft_s": [round(v, 2) for v in short], "long_ttft_s": [round(v, 2) for v in long],
           "short_ttft_p50_s": round(statistics.median(short), 2),
           "long_ttft_p50_s": round(statistics.median(long), 2)}
    print(json.dumps({k: res[k] for k in ("commit", "duration_s", "short_ttft_p50_s",
                                          "short_ttft_s", "long_ttft_s")}))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
