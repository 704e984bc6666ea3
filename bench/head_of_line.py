"""Head-of-line blocking: the time to first token of a short request that arrives while a long
prompt is being prefilled, on one `specdec serve`.

Each trial sends a long prompt (HumanEval text, about `--long-tokens` tokens, made unique so the
prefix cache cannot serve it) and, `--delay` seconds later, a short one; both stream, one token
each. The short request's TTFT alone is measured first. `--trees` runs the same trials against
the server of other source trees (a `git worktree` of another commit, say), one server at a
time, to compare scheduling policies in one run.

    python bench/head_of_line.py --trees OLD_TREE,. \\
        --out bench/results/head_of_line_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import REPO, _cpu_model, _wait_ready, stop_servers


def ttft(url: str, prompt: str, out: dict[str, float], key: str) -> None:
    t0 = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "speculative": {"method": "none"}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out[key] = time.perf_counter() - t0
                return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trees", default=".", help="source trees to serve from, in turn")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--delay", type=float, default=0.5)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--port", type=int, default=8099)
    p.add_argument("--serve-args", default="", help="extra `specdec serve` arguments")
    a = p.parse_args()

    from prompts import humaneval_texts

    corpus = "\n".join(humaneval_texts(164))
    long_text = corpus[: a.long_tokens * 3]  # 9000 characters: 2496 tokens for qwen2.5-coder
    short = "def add(a, b):\n    return"
    results: dict[str, Any] = {}
    for tree in a.trees.split(","):
        root = Path(tree).resolve()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                capture_output=True, text=True).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                          capture_output=True, text=True).stdout.strip():
            commit += "+changes"
        env = dict(os.environ, PYTHONPATH=str(root))
        log = open(Path(a.out).with_suffix(f".{commit}.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model",
                                 a.model, "--port", str(a.port), *a.serve_args.split()],
                                cwd=root, env=env,
                                stdout=log, stderr=log)
        url = f"http://127.0.0.1:{a.port}"
        trials = []
        try:
            _wait_ready(url, proc, 900)
            alone: dict[str, float] = {}
            ttft(url, short + " 0", alone, "short")  # warm-up
            for i in range(a.trials):
                ttft(url, short + f" {i + 1}", alone, "short")
                t: dict[str, float] = {"short_alone_s": alone["short"]}
                long_thread = threading.Thread(target=ttft, args=(
                    url, f"# trial {time.time()} {i}\n" + long_text, t, "long_s"))
                long_thread.start()
                time.sleep(a.delay)
                ttft(url, short + f" {i + 100}", t, "short_behind_long_s")
                long_thread.join()
                trials.append(t)
                print(f"{commit} trial {i}: {t}", flush=True)
        finally:
            stop_servers([proc])
        results[commit] = {
            "tree": str(root), "trials": trials,
            "short_behind_long_s_median": statistics.median(
                t["short_behind_long_s"] for t in trials),
            "long_s_median": statistics.median(t["long_s"] for t in trials),
            "short_alone_s_median": statistics.median(t["short_alone_s"] for t in trials)}
    out = {"what": "TTFT of a short request arriving during a long prefill",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": _cpu_model(), "cores": os.cpu_count()},
           "settings": vars(a), "results": results, "repo": str(REPO)}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: {m: v for m, v in r.items() if m.endswith("median")}
                      for k, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
