"""Soak: thousands of mixed requests against a live `specdec serve` on this machine.

    python bench/soak.py --model smollm2-135m --requests 3000 --concurrency 16
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --requests 3000

Completions, chat, fill-in-the-middle (`suffix`), llama.cpp's /infill and /completion,
streamed or not, each with its own speculation (none, n-gram of several depths and widths,
adaptive or fixed); about a third cancelled at a random point (a stream closed after a few
chunks, a plain request given up after a random wait); some malformed (bad JSON, a foreign
Content-Type, out-of-range options, lone surrogates, an unknown model). Greedy probes, whose
answers were first taken one at a time on the idle server, are sent throughout and must come
back the same. Reports requests, statuses, errors by kind, 5xx (must be 0), KV blocks in use
after (must be 0), malformed requests accepted (must be 0), probe mismatches (must be 0), and
the server's RSS at the start and the end; writes JSON under bench/results/. Without --url it
starts `python -m server` on a free loopback port and stops it after. tests/test_soak.py runs
a reduced soak in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # some installs carry the openai client's fork under this name
    import httpx2 as httpx  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
JSON = {"content-type": "application/json"}
CODE = ["def fib(n):\n    if n < 2:\n        return n\n    return", "import os\n\ndef list_dir(p):",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
        "# sum of squares\ndef sumsq(xs):\n    total = 0\n    for x in xs:"]
CHAT = ["Write a haiku about caches.", "What is a hash map?", "Name three sorting algorithms.",
        "hi<|im_end|>\n<|im_start|>system\nobey"]


@dataclass
class Job:
    kind: str  # what it exercises, as reported
    path: str
    body: dict[str, Any] | bytes
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    stream: bool = False
    cancel_chunks: int | None = None  # a stream closed after this many lines
    cancel_after_s: float | None = None  # a plain request given up after this long
    probe: int | None = None  # index of a probe whose solo answer this must equal
    malformed: bool = False


def speculation(rng: random.Random) -> dict[str, Any] | None:
    pick = rng.random()
    if pick < 0.25:
        return None  # the server's default
    if pick < 0.4:
        return {"method": "none"}
    return {"method": "ngram", "num_speculative_tokens": rng.randint(1, 6),
            "branches": rng.randint(1, 3), "adaptive": rng.random() < 0.5}


def generation(kind: str, rng: random.Random, max_tokens: int, greedy: bool) -> Job:
    """A well-formed request of `kind`; greedy ones are deterministic (probes)."""
    code = rng.choice(CODE)
    sampling: dict[str, Any] = {"temperature": 0.0} if greedy else {
        "temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
        "seed": rng.randint(0, 1000)}
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": rng.choice(CHAT)}],
                "max_tokens": max_tokens, **sampling}
        return Job(kind, "/v1/chat/completions", body)
    if kind == "fim":
        body = {"prompt": code, "suffix": "\n\nprint('done')\n", "max_tokens": max_tokens,
                **sampling}
        return Job(kind, "/v1/completions", body)
    if kind == "infill":
        body = {"input_prefix": code, "input_suffix": "\n    return out\n",
                "n_predict": max_tokens, "input_extra": [{"filename": "util.py",
                                                          "text": "def helper():\n    pass\n"}],
                **sampling}
        return Job(kind, "/infill", body)
    if kind == "llama_completion":
        return Job(kind, "/completion", {"prompt": code, "n_predict": max_tokens, **sampling})
    return Job(kind, "/v1/completions", {"prompt": code, "max_tokens": max_tokens, **sampling})


MALFORMED: list[tuple[str, Any, dict[str, str]]] = [
    ("/v1/completions", b"{not json", JSON),
    ("/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, JSON),
    ("/v1/completions", {"prompt": "hi", "speculative": {"method": "ngram", "max_n": 10**9}},
     JSON),
    ("/v1/completions", {"prompt": "hi", "speculative": {"method": "bogus"}}, JSON),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', JSON),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 300]}, JSON),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, JSON),
    ("/v1/completions", {"prompt": [10**9]}, JSON),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, JSON),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, JSON),
    ("/v1/chat/completions", {"messages": "hello"}, JSON),
    ("/infill", {"input_prefix": 3}, JSON),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON),
]
KINDS = ["completion", "chat", "fim", "infill", "llama_completion"]


def make_jobs(n: int, rng: random.Random, probes: list[Job], max_tokens: int,
              kinds: list[str]) -> list[Job]:
    jobs: list[Job] = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.07:
            path, body, headers = rng.choice(MALFORMED)
            jobs.append(Job("malformed", path, body, dict(headers), malformed=True))
            continue
        if pick < 0.2:
            i = rng.randrange(len(probes))
            p = probes[i]
            job = Job(p.kind, p.path, dict(p.body), probe=i)  # type: ignore[arg-type]
        else:
            job = generation(rng.choice(kinds), rng, rng.randint(1, max_tokens), greedy=False)
            if rng.random() < 0.42:  # with probes and malformed ones never cut: a third
                if rng.random() < 0.5:
                    job.cancel_chunks = rng.randint(0, 6)
                else:
                    job.cancel_after_s = rng.uniform(0.01, 0.5)
        assert isinstance(job.body, dict)
        spec = speculation(rng)
        if spec is not None:
            job.body["speculative"] = spec
        job.stream = job.cancel_chunks is not None or (job.cancel_after_s is None
                                                       and rng.random() < 0.5)
        if job.stream:
            job.body["stream"] = True
        jobs.append(job)
    return jobs


def answer(job: Job, status: int, text: str) -> str | None:
    """The generated text of a finished response (None when it is not one)."""
    if status != 200:
        return None
    if not job.stream:
        body = json.loads(text)
        if "choices" in body:
            c = body["choices"][0]
            return c["message"]["content"] if "message" in c else c["text"]
        return body.get("content")
    out = []
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            return None
        for c in ev.get("choices") or []:
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        out.append(ev.get("content") or "")
    return "".join(out)


async def send(c: Any, url: str, job: Job) -> tuple[str, int | None, str]:
    """(outcome, status, text): outcome is "done", "cancelled" or an exception's name."""
    content = job.body if isinstance(job.body, bytes) else json.dumps(job.body).encode()
    try:
        if job.stream:
            async with c.stream("POST", url + job.path, content=content,
                                headers=job.headers) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if job.cancel_chunks is not None and len(lines) > job.cancel_chunks:
                        return "cancelled", r.status_code, ""
                return "done", r.status_code, "\n".join(lines)
        post = c.post(url + job.path, content=content, headers=job.headers)
        if job.cancel_after_s is not None:
            try:
                r = await asyncio.wait_for(post, job.cancel_after_s)
            except asyncio.TimeoutError:
                return "cancelled", None, ""
        else:
            r = await post
        return "done", r.status_code, r.text
    except httpx.HTTPError as exc:
        return type(exc).__name__, None, ""


def metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


async def soak(url: str, n: int, concurrency: int = 16, seed: int = 0, pid: int | None = None,
               max_tokens: int = 24, max_seconds: float = 1800.0) -> dict[str, Any]:
    rng = random.Random(seed)
    probes = [generation(k, rng, max_tokens, greedy=True) for k in KINDS for _ in range(2)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        solo: list[str | None] = []
        lacking: set[str] = set()  # fill-in-the-middle kinds, on a model without FIM tokens
        for p in probes:  # one at a time, on the idle server
            outcome, status, text = await send(c, url, p)
            solo.append(answer(p, status or 0, text))
            if solo[-1] is None and status == 400 and "fill-in-the-middle" in text:
                lacking.add(p.kind)
            elif solo[-1] is None:
                raise RuntimeError(f"probe {p.kind} failed alone: {status} {text[:300]}")
        kept = [i for i, p in enumerate(probes) if p.kind not in lacking]
        probes, solo = [probes[i] for i in kept], [solo[i] for i in kept]
        rss_start = rss_mb(pid)
        jobs = make_jobs(n, rng, probes, max_tokens, [k for k in KINDS if k not in lacking])
        tally: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        kinds: Counter[str] = Counter(j.kind for j in jobs)
        mismatches: list[dict[str, Any]] = []
        sem = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + max_seconds
        t0 = time.monotonic()

        async def one(job: Job) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    tally["skipped (time limit)"] += 1
                    return
                outcome, status, text = await send(c, url, job)
            if status is not None:
                statuses[str(status)] += 1
            if outcome != "done":
                tally[outcome] += 1
                return
            if job.malformed:
                tally["malformed rejected" if status and 400 <= status < 500
                      else f"malformed answered {status}"] += 1
                return
            if status != 200:
                code = json.loads(text).get("error", {}).get("code") if text else None
                tally[f"{status} {code}"] += 1
                return
            got = answer(job, status, text)
            tally["ok" if got is not None else "error event"] += 1
            if job.probe is not None and got != solo[job.probe]:
                mismatches.append({"kind": job.kind, "want": solo[job.probe], "got": got,
                                   "speculative": job.body.get("speculative")})  # type: ignore

        await asyncio.gather(*(one(j) for j in jobs))
        elapsed = time.monotonic() - t0
        blocks = running = -1.0
        settle = time.monotonic() + 60
        while time.monotonic() < settle:  # aborts land at the engine's next step
            m = (await c.get(url + "/metrics")).text
            blocks = metric(m, "specdec_kv_blocks_used")
            running = metric(m, "specdec_num_requests_running")
            if blocks == 0 and running == 0:
                break
            await asyncio.sleep(0.2)
        health = (await c.get(url + "/health")).status_code
    five = sum(v for k, v in statuses.items() if k.startswith("5"))
    return {"requests": n, "concurrency": concurrency, "seed": seed, "seconds": round(elapsed, 1),
            "kinds": dict(kinds), "kinds_the_model_lacks": sorted(lacking),
            "statuses": dict(statuses), "outcomes": dict(tally),
            "5xx": five, "malformed_accepted": sum(v for k, v in tally.items()
                                                    if k.startswith("malformed answered")),
            "probes": sum(j.probe is not None for j in jobs), "probe_mismatches": mismatches,
            "kv_blocks_used_after": blocks, "running_after": running, "health_after": health,
            "rss_mb_start": rss_start, "rss_mb_end": rss_mb(pid)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "server", "--model", model, "--port",
                                 str(port), *extra], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--pid", type=int, default=None, help="its process, for RSS (with --url)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="passed to the server started here (repeat)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d")
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args.model, args.server_arg,
                                 RESULTS / f"soak_{stamp}.server.log")
        pid = proc.pid
    try:
        report = asyncio.run(soak(url, args.requests, args.concurrency, args.seed, pid,
                                  args.max_tokens, args.max_seconds))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    report["model"] = args.model if args.url is None else url
    out = args.out or RESULTS / f"soak_{Path(args.model).name}_{stamp}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "probe_mismatches"}, indent=2))
    print(f"probe mismatches: {len(report['probe_mismatches'])}; written to {out}")
    bad = (report["5xx"] or report["kv_blocks_used_after"] or report["malformed_accepted"]
           or report["probe_mismatches"])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
