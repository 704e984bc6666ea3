"""specdec against llama.cpp on the CPU, side by side, on the same GGUF files.

Servers start one at a time (each ready before the next starts, so that none measures the
machine while another loads) and run side by side, each idle while another is timed:
llama.cpp's `llama-server` on the target alone, `llama-server` with the draft model (`-md DRAFT
--draft-max 8`), and `specdec serve` with its defaults (plain requests send `"speculative":
{"method": "none"}`; speculative ones send nothing, so they measure the default
configuration). Every request is greedy, streams, and is forced to `--tokens` new tokens
(`ignore_eos`; llama.cpp also gets a -inf `logit_bias` on the tokenizer's added tokens, since
its `ignore_eos` spares only EOS and it would stop at the
other end-of-generation tokens); the engines take turns prompt by prompt.
Decode tok/s is measured the same way for every engine, at the client: (tokens - 1) over the
time from the first streamed token to the last. TTFT is the time to the first token. RSS is each
server's resident memory after its requests (VmRSS), with its peak (VmHWM); a fourth server,
`specdec serve --speculative none` (engine `specdec_plain_only`, no draft model loaded), gives
the RSS to hold against llama.cpp's target-alone server. With `--passes N` every prompt runs N
times per engine, the engines taking turns each time, and a prompt's figures are its fastest
run's: on a machine whose neighbours move one run by 15%, per-prompt ratios need it.

`--isa avx2` runs both engines as on a CPU without AVX-512 (most laptops): llama.cpp's `avx2/`
build, and specdec with `--cpu-kernel avx2` and PyTorch's own kernels held to AVX2
(`ATEN_CPU_CAPABILITY=avx2`).

    python bench/cpu_vs_llamacpp.py --out bench/results/cpu_vs_llamacpp_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import datetime
import json
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
REPO = Path(__file__).resolve().parent.parent
PEER = REPO.parent / "shared" / "peers" / "llama.cpp" / "run"


def _proc_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """Terminate every server, then wait for each (killing one that takes over 30 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stream(url: str, body: dict[str, Any], llama: bool) -> dict[str, Any]:
    """One streamed request; client-side timings and the engine's own where it gives them."""
    t0 = time.perf_counter()
    first = last = None
    text, final = [], {}
    path = "/completion" if llama else "/v1/completions"
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            piece = ev.get("content", "") if llama else "".join(
                c.get("text", "") for c in ev.get("choices", []))
            if piece:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                text.append(piece)
            if llama and ev.get("stop"):
                final = ev
            if not llama and ev.get("usage"):
                final = ev
    if llama:
        n = int(final.get("tokens_predicted", 0))
        engine_tps = final.get("timings", {}).get("predicted_per_second")
        spec = None
    else:
        usage = final.get("usage", {})
        n = int(usage.get("completion_tokens", 0))
        engine_tps, spec = None, usage.get("speculative")
    assert first is not None and last is not None
    return {"tokens": n, "ttft_s": first - t0, "decode_tok_s": (n - 1) / max(last - first, 1e-9),
            "total_s": last - t0, "engine_decode_tok_s": engine_tps, "speculative": spec,
            "text": "".join(text)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--engines", default="llama_plain,llama_spec,specdec_plain,specdec_spec,"
                   "specdec_plain_only")
    p.add_argument("--specdec-args", default="", help="extra `specdec serve` arguments")
    p.add_argument("--dataset", default="humaneval", choices=["humaneval", "sharegpt"])
    p.add_argument("--passes", type=int, default=1,
                   help="runs of each prompt per engine, the engines taking turns each time; a "
                        "prompt's figures are its fastest run's (this machine's neighbours "
                        "move one run by 15%%)")
    p.add_argument("--isa", default="native", choices=["native", "avx2"],
                   help="avx2: both engines as on a CPU without AVX-512 (see above)")
    a = p.parse_args()

    from prompts import humaneval_texts, sharegpt_texts
    from transformers import AutoTokenizer

    from specdec.hub import PRESETS, cache_root, pull

    draft = PRESETS[a.target].draft
    special = sorted(AutoTokenizer.from_pretrained(pull(a.target, progress=False))
                     .added_tokens_decoder)
    pull(draft, progress=False)
    tgt = cache_root() / "gguf" / PRESETS[a.target].gguf_name
    dft = cache_root() / "gguf" / PRESETS[draft].gguf_name
    engines = a.engines.split(",")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    peer, specdec_args = [str(PEER), "llama-server"], a.specdec_args.split()
    if a.isa == "avx2":
        build = PEER.parent / "avx2"
        peer = ["env", f"LD_LIBRARY_PATH={build}", str(build / "llama-server")]
        specdec_args += ["--cpu-kernel", "avx2"]
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    logs = Path(a.out).with_suffix(".servers.log").open("w")
    try:
        common = ["-t", str(a.threads), "-c", "4096", "-np", "1", "--no-webui"]
        t_start: dict[str, float] = {}

        def start(names: list[str], cmd: list[str], url: str) -> None:
            # One server at a time, each ready before the next starts: a server's start-up
            # measures this machine (kernel paths, step costs), which another loading would
            # skew.
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=logs, stderr=logs, env=env)
            for name in names:
                servers[name] = (proc, url)
            _wait_ready(url, proc, 1800)
            for name in names:
                t_start[name] = time.monotonic() - t0

        if "llama_plain" in engines:
            start(["llama_plain"], [*peer, "-m", str(tgt), "--port", "8091", *common],
                  "http://127.0.0.1:8091")
        if "llama_spec" in engines:
            start(["llama_spec"], [*peer, "-m", str(tgt), "-md", str(dft),
                                   "--draft-max", str(a.draft_max), "--port", "8092", *common],
                  "http://127.0.0.1:8092")
        if any(e in engines for e in ("specdec_plain", "specdec_spec")):
            start(["specdec_plain", "specdec_spec"],
                  [sys.executable, "-m", "specdec.cli", "serve", "--model", a.target, "--port",
                   "8093", *specdec_args], "http://127.0.0.1:8093")
        if "specdec_plain_only" in engines:  # no draft model loaded: RSS against llama_plain
            start(["specdec_plain_only"],
                  [sys.executable, "-m", "specdec.cli", "serve", "--model", a.target, "--port",
                   "8094", "--speculative", "none", *specdec_args],
                  "http://127.0.0.1:8094")
        texts = (humaneval_texts if a.dataset == "humaneval" else sharegpt_texts)(a.prompts)
        results: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        # One short warm-up request each (first-use costs: kernel choice, page faults).
        for e in engines:
            _run(e, servers[e][1], texts[0], 8, special)
        for i, prompt in enumerate(texts):
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for j in range(a.passes):
                order = engines if (i * a.passes + j) % 2 == 0 else engines[::-1]
                for e in order:
                    r = _run(e, servers[e][1], prompt, a.tokens, special)
                    runs[e].append(r)
                    print(f"prompt {i} {e}: {r['decode_tok_s']:.2f} tok/s, ttft "
                          f"{r['ttft_s']:.2f} s" + (f", tau {r['speculative'].get('tau')}"
                                                    if r.get("speculative") else ""), flush=True)
            for e, rs in runs.items():
                best = dict(max(rs, key=lambda r: r["decode_tok_s"]))
                best["decode_tok_s_passes"] = [r["decode_tok_s"] for r in rs]
                results[e].append(best)
        rss = {e: {"rss_mb": _proc_kb(servers[e][0].pid, "VmRSS") / 1024,
                   "peak_rss_mb": _proc_kb(servers[e][0].pid, "VmHWM") / 1024}
               for e in engines}
    finally:
        stop_servers(list({id(proc): proc for proc, _ in servers.values()}.values()))
        logs.close()

    summary = {e: {"decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
                   "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
                   "ready_s": t_start.get(e), **rss[e]} for e, rs in results.items()}
    ratios: dict[str, float] = {}
    s = summary
    if "llama_plain" in s and "specdec_plain" in s:
        ratios["plain_decode_vs_llama_plain"] = (s["specdec_plain"]["decode_tok_s_median"]
                                                 / s["llama_plain"]["decode_tok_s_median"])
        plain_rss = s.get("specdec_plain_only", s["specdec_plain"])["rss_mb"]
        ratios["rss_vs_llama_plain"] = plain_rss / s["llama_plain"]["rss_mb"]
    if "specdec_spec" in s:
        peers = [(s[e]["decode_tok_s_median"], e) for e in ("llama_plain", "llama_spec") if e in s]
        if peers:
            best = max(peers)
            ratios["spec_decode_vs_llama_best"] = (s["specdec_spec"]["decode_tok_s_median"]
                                                   / best[0])
            ratios["llama_best"] = best[1]
        if "specdec_plain" in s:
            ratios["spec_vs_own_plain"] = (s["specdec_spec"]["decode_tok_s_median"]
                                           / s["specdec_plain"]["decode_tok_s_median"])
        if "llama_spec" in s:
            ratios["rss_spec_vs_llama_spec"] = (s["specdec_spec"]["rss_mb"]
                                                / s["llama_spec"]["rss_mb"])
    if "specdec_plain" in results and "specdec_spec" in results:
        per = [y["decode_tok_s"] / x["decode_tok_s"]
               for x, y in zip(results["specdec_plain"], results["specdec_spec"])]
        ratios["spec_vs_own_plain_per_prompt_min"] = min(per)
        ratios["spec_vs_own_plain_per_prompt"] = per
    if "specdec_plain" in results and "specdec_plain_only" in results:
        # The same work on two servers: how far one prompt's ratio moves with the machine alone
        # (on the 2-core CPU 0.86-1.31x at 2 passes in
        # bench/results/cpu_vs_llamacpp_20261207_share.json), the resolution of the per-prompt
        # ratios above.
        ratios["plain_vs_plain_only_per_prompt"] = [
            x["decode_tok_s"] / y["decode_tok_s"]
            for x, y in zip(results["specdec_plain"], results["specdec_plain_only"])]
    same = None
    if "llama_plain" in results and "specdec_plain" in results:
        same = sum(x["text"] == y["text"] for x, y in zip(results["llama_plain"],
                                                          results["specdec_plain"]))
    out = {
        "what": f"bench/cpu_vs_llamacpp.py: {a.dataset} prompts, greedy, forced length, batch 1"
                + (", both engines as on an AVX2-only CPU (--isa avx2)" if a.isa == "avx2" else ""),
        "isa": a.isa,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=REPO).stdout.strip(),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"torch": __import__("torch").__version__, "llama.cpp": _peer_commit()},
        "settings": vars(a), "target_gguf": tgt.name, "draft_gguf": dft.name,
        "summary": summary, "ratios": ratios,
        "plain_outputs_identical_to_llama_cpp": same, "per_request": results,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"summary": summary, "ratios": ratios,
                      "plain_outputs_identical_to_llama_cpp": same}, indent=1))


def _run(engine: str, url: str, prompt: str, n: int, special: list[int]) -> dict[str, Any]:
    if engine.startswith("llama"):
        body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "cache_prompt": False,
                "logit_bias": [[t, False] for t in special]}
        return _stream(url, body, llama=True)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": n, "ignore_eos": True,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if engine == "specdec_plain":  # the default server, this request without speculation
        body["speculative"] = {"method": "none"}
    return _stream(url, body, llama=False)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _peer_commit() -> str:
    readme = PEER.parent / "README.md"
    for word in readme.read_text().split() if readme.is_file() else []:
        if len(word) == 40 and all(c in "0123456789abcdef" for c in word):
            return word
    return "unknown"


if __name__ == "__main__":
    main()
