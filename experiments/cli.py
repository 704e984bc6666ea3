"""`specdec ab`: export an experiment's records, report on it, or run one offline."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from experiments.offline import load_definition, load_prompts, normalize_definition, run_offline
from experiments.record import RequestRecord
from experiments.report import format_table, write_plots
from experiments.stats import slot_seconds_of, summarize
from experiments.store import RecordStore
from specdec.cli_options import HelpFormatter, runtime_from_env


def _add_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="folder for summary.json and the PNG plots "
                                               "(default: ab-NAME)")
    p.add_argument("--alpha", type=float, default=0.05, help="1 - the intervals' coverage")
    p.add_argument("--mde", type=float, default=0.05,
                   help="the relative change to size the experiment for (80%% power)")


def _export(a: argparse.Namespace) -> int:
    with RecordStore(a.db) as store:
        if a.name is not None and a.name not in store.experiments():
            print(f"specdec ab: no experiment {a.name!r} in {a.db}", file=sys.stderr)
            return 1
        if a.output in (None, "-"):
            n = store.export_csv(a.name, sys.stdout)
        else:
            with open(a.output, "w", newline="") as f:
                n = store.export_csv(a.name, f)
    print(f"specdec ab: {n} records", file=sys.stderr)
    return 0


def _fetch(url: str, name: str, key: str | None) -> tuple[list[RequestRecord], dict[str, Any]]:
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/experiments/{name}/records")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"specdec ab: {req.full_url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"specdec ab: {req.full_url}: {e.reason}") from None
    return [RequestRecord.from_dict(d) for d in body["records"]], body["experiment"]


def report(name: str, records: list[RequestRecord], definition: dict[str, Any],
           out: str | Path, alpha: float, mde: float) -> dict[str, Any]:
    """Summarize, print the table, and write summary.json and the plots into `out`."""
    d = normalize_definition({"name": name, **definition}, where=name)
    summary = summarize(records, control=d["control"], arms=list(d["arms"]),
                        weights=d["weights"], design=d["design"], alpha=alpha, mde=mde,
                        slot_seconds=slot_seconds_of(d))
    print(format_table(summary, name))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    paths = write_plots(summary, records, out)
    print(f"\nwrote {out / 'summary.json'} and {', '.join(p.name for p in paths)}")
    return summary


def _report(a: argparse.Namespace) -> int:
    if a.url:
        records, definition = _fetch(a.url, a.name, a.api_key or os.environ.get("SPECDEC_API_KEY"))
    else:
        with RecordStore(a.db) as store:
            definition = store.experiment(a.name)
            records = store.records(a.name)
        if definition is None:
            print(f"specdec ab: {a.db} holds no definition of experiment {a.name!r}",
                  file=sys.stderr)
            return 1
    report(a.name, records, definition, a.out or f"ab-{a.name}", a.alpha, a.mde)
    return 0


def _run(a: argparse.Namespace) -> int:
    from specdec import LLM

    try:
        d = load_definition(a.arms, a.name)
    except (OSError, ValueError) as e:
        print(f"specdec ab: --arms {a.arms}: {e}", file=sys.stderr)
        return 2
    name = d["name"]
    out = Path(a.out or f"ab-{name}")
    store = RecordStore(a.db or out / "records.sqlite")
    if store.records(name):
        print(f"specdec ab: {store.path} already holds records of experiment {name!r}; give "
              "another --db or rename the experiment", file=sys.stderr)
        store.close()
        return 1
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, speculative={"method": "none"},
              adaptive_speculation=not a.no_adaptive_speculation, runtime=runtime_from_env())
    prompts = load_prompts(a.data, llm.tokenizer, a.limit, a.max_prompt_tokens)
    print(f"specdec ab: {len(prompts)} prompts x {len(d['arms'])} arms", file=sys.stderr)
    params = {"temperature": a.temperature, "max_tokens": a.max_tokens, "seed": a.seed,
              "ignore_eos": a.ignore_eos}
    # Every arm sees every prompt: the counts are equal by construction, whatever the weights.
    stored = {**d, "weights": {arm: 1.0 for arm in d["arms"]},
              "description": f"offline run: model {a.model}, data {a.data}"}
    stored.pop("slot_seconds", None)
    stored.pop("burn_in_seconds", None)
    store.save_experiment(name, stored)
    try:
        records, seconds = run_offline(llm, d, prompts, params, slots=a.slots,
                                       seed=a.seed or 0, sink=store.append)
        if seconds:  # measured, per slot (no burn-in: each slot runs its prompts from idle)
            stored["slot_seconds"] = {str(k): v for k, v in seconds.items()}
            store.save_experiment(name, stored)
    finally:
        store.close()
    report(name, records, stored, out, a.alpha, a.mde)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec ab", formatter_class=HelpFormatter,
                                description="A/B experiments between drafters")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="write an experiment's records as CSV",
                       formatter_class=HelpFormatter)
    e.add_argument("--db", required=True, help="the experiments SQLite file")
    e.add_argument("name", nargs="?", default=None, help="one experiment (default: all)")
    e.add_argument("-o", "--output", default=None, help="CSV file (default: stdout)")
    e.set_defaults(fn=_export)

    r = sub.add_parser("report", help="print an experiment's statistics and plot them",
                       formatter_class=HelpFormatter)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, e.g. http://localhost:8000")
    src.add_argument("--db", help="the experiments SQLite file")
    r.add_argument("--api-key", default=None, help="default: $SPECDEC_API_KEY")
    r.add_argument("name")
    _add_stats_args(r)
    r.set_defaults(fn=_report)

    u = sub.add_parser("run", help="run an experiment offline over a data set",
                       formatter_class=HelpFormatter)
    u.add_argument("--data", required=True, help="humaneval, sharegpt or a JSONL file of "
                                                 "{\"text\": ...} or {\"prompt\": ...} rows")
    u.add_argument("--arms", required=True, help="experiment file (JSON or YAML), the format "
                                                 "of `specdec serve --experiments`")
    u.add_argument("--name", default=None, help="the experiment to run where the file has "
                                                "several")
    u.add_argument("--model", required=True)
    u.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    u.add_argument("--device", default="cpu")
    u.add_argument("--max-tokens", type=int, default=128)
    u.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts are cut")
    u.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    u.add_argument("--temperature", type=float, default=0.0)
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--ignore-eos", action="store_true", help="always emit --max-tokens tokens")
    u.add_argument("--slots", type=int, default=4,
                   help="switchback: prompt chunks, each run under every arm in random order")
    u.add_argument("--no-adaptive-speculation", action="store_true")
    u.add_argument("--db", default=None, help="SQLite file for the records "
                                              "(default: OUT/records.sqlite)")
    _add_stats_args(u)
    u.set_defaults(fn=_run)

    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
