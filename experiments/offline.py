"""`specdec ab run`: an experiment run offline through the Python API over a data set.

Every arm sees the same prompts, in turn, so the arms differ only in their drafter. Under
design "switchback" the prompts are cut into chunks and each chunk runs under every arm in a
random order; each (chunk, arm) run is one slot, timed, so that latency is compared over slots
as on a live server.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.record import RequestRecord

# Shorthands an arms file may use for the engine's speculative options.
_ALIASES = {"k": "num_speculative_tokens"}


def normalize_definition(raw: dict[str, Any], where: str = "experiment") -> dict[str, Any]:
    """The definition with its defaults filled in: arms as {name: speculative dict}, control
    (the arm named "control", else the first), weights (equal where missing), design
    ("request"). Raises ValueError naming the field at fault."""
    arms = raw.get("arms")
    if isinstance(arms, list):
        arms = {str(a): {"method": "none"} if str(a) == "control" else {} for a in arms}
    if not isinstance(arms, dict) or len(arms) < 2:
        raise ValueError(f"{where}.arms: give at least two arms as {{name: speculative}}")
    specs = {}
    for name, spec in arms.items():
        if not isinstance(spec, dict):
            raise ValueError(f"{where}.arms.{name}: a speculative dict such as "
                             "{'method': 'ngram', 'k': 4}")
        specs[str(name)] = {_ALIASES.get(k, k): v for k, v in spec.items()}
    control = str(raw.get("control") or ("control" if "control" in specs else next(iter(specs))))
    if control not in specs:
        raise ValueError(f"{where}.control: {control!r} is not one of the arms {list(specs)}")
    weights = raw.get("weights") or {a: 1.0 for a in specs}
    if not isinstance(weights, dict) or set(weights) - set(specs):
        raise ValueError(f"{where}.weights: a {{arm: weight}} map over the arms {list(specs)}")
    try:
        weights = {a: float(weights.get(a, 0.0)) for a in specs}
    except (TypeError, ValueError):
        raise ValueError(f"{where}.weights: every weight must be a number") from None
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"{where}.weights: weights must be >= 0 and not all 0")
    design = str(raw.get("design") or "request")
    if design not in ("request", "switchback"):
        raise ValueError(f"{where}.design: 'request' or 'switchback', got {design!r}")
    return {**raw, "name": str(raw.get("name") or "offline"), "arms": specs,
            "control": control, "weights": weights, "design": design}


def load_definition(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """One experiment from a JSON or YAML file, checked as `specdec serve --experiments`
    checks it (experiments/config.py): a single definition, a list of them, or
    {"experiments": [...]}; `name` picks one where the file holds several (else the first).
    An arm may write `k` for `num_speculative_tokens`."""
    from experiments.config import parse_experiment, parse_experiments

    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        doc: Any = yaml.safe_load(text)
    else:
        doc = json.loads(text)
    if isinstance(doc, dict) and "arms" in doc:
        doc = dict(doc, name=doc.get("name") or "offline")
        experiments = [parse_experiment(_expand_aliases(doc))]
    else:
        if isinstance(doc, dict) and isinstance(doc.get("experiments"), list):
            doc = {"experiments": [_expand_aliases(d) for d in doc["experiments"]]}
        elif isinstance(doc, list):
            doc = [_expand_aliases(d) for d in doc]
        experiments = parse_experiments(doc)
    if name is not None:
        experiments = [e for e in experiments if e.name == name]
        if not experiments:
            raise ValueError(f"no experiment named {name!r}")
    if not experiments:
        raise ValueError("the file holds no experiment")
    e = experiments[0]
    return normalize_definition(e.to_dict(), where=e.name)


def _expand_aliases(d: Any) -> Any:
    if not isinstance(d, dict) or not isinstance(d.get("arms"), dict):
        return d
    arms = {a: {_ALIASES.get(k, k): v for k, v in spec.items()} if isinstance(spec, dict)
            else spec for a, spec in d["arms"].items()}
    return {**d, "arms": arms}


def load_prompts(data: str, tokenizer: Any, limit: int | None,
                 max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of "humaneval", "sharegpt" or a JSONL file of {"text"} or {"prompt"} rows."""
    from specdec.drafter_data import encode, texts

    if data not in ("humaneval", "sharegpt") and not Path(data).is_file():
        raise SystemExit(f"--data: {data!r} is neither humaneval, sharegpt nor a JSONL file")
    items = texts(data, limit if limit is not None else 10**9, skip=0)
    prompts = encode(tokenizer, items, max_prompt_tokens)
    if not prompts:
        raise SystemExit(f"--data {data}: no prompt of at least two tokens")
    return prompts


def _record(name: str, arm: str, unit: str, slot: int | None, out: Any, done: float,
            wall: float) -> RequestRecord:
    n = len(out.token_ids)
    spec = out.spec if out.spec is not None and out.spec.method != "none" else None
    first = out.first_token_time
    ttft = first - out.arrival_time if first is not None else None
    tpot = (done - first) / (n - 1) if first is not None and n > 1 else None
    return RequestRecord(
        experiment=name, arm=arm, unit=unit, request_id=out.request_id, slot=slot,
        in_burn_in=False, finished_at=wall, prompt_tokens=len(out.prompt_token_ids),
        output_tokens=n, draft_tokens=spec.draft_tokens if spec else 0,
        accepted_tokens=spec.accepted_tokens if spec else 0,
        # Without speculation every token after the prefill's first is one decode step.
        steps=spec.steps if spec else max(n - 1, 0),
        accepted_per_position=list(spec.accepted_per_position) if spec else [],
        drafted_per_position=list(spec.drafted_per_position) if spec else [],
        ttft_s=ttft, tpot_s=tpot, finish_reason=out.finish_reason)


def _run_slot(llm: Any, name: str, arm: str, spec: dict[str, Any], prompts: list[list[int]],
              units: list[str], slot: int | None, params: dict[str, Any]
              ) -> list[RequestRecord]:
    from specdec import SamplingParams

    sp = SamplingParams(speculative=spec, **params)
    # Outputs come back in engine order: a request's prompt tells which unit it is.
    waiting: dict[tuple[int, ...], list[str]] = {}
    for p, u in zip(prompts, units):
        waiting.setdefault(tuple(p), []).append(u)
    records = []
    for out in llm.stream(prompts, sp):
        if out.finished:
            uid = waiting[tuple(out.prompt_token_ids)].pop(0)
            records.append(_record(name, arm, uid, slot, out, time.monotonic(), time.time()))
    return records


def run_offline(llm: Any, definition: dict[str, Any], prompts: list[list[int]],
                params: dict[str, Any], slots: int = 4, seed: int = 0,
                sink: Callable[[RequestRecord], None] | None = None
                ) -> tuple[list[RequestRecord], dict[int, float]]:
    """Run every arm over `prompts`; returns the records and, under switchback, the measured
    seconds of each slot. `params` are SamplingParams fields shared by all arms; `sink` gets
    each slot's records as soon as the slot ends (so an interrupted run keeps them)."""
    records: list[RequestRecord] = []

    def keep(new: list[RequestRecord]) -> None:
        records.extend(new)
        for r in new:
            if sink is not None:
                sink(r)

    name, arms = definition["name"], definition["arms"]
    units = [f"prompt-{i}" for i in range(len(prompts))]
    # Loads each arm's drafter and warms its code paths, outside any measured slot.
    for spec in arms.values():
        _run_slot(llm, name, "warmup", spec, prompts[:4], units[:4], None,
                  {**params, "max_tokens": 4})
    seconds: dict[int, float] = {}
    if definition["design"] != "switchback":
        for arm, spec in arms.items():
            keep(_run_slot(llm, name, arm, spec, prompts, units, None, params))
        return records, seconds
    rng = random.Random(seed)
    n_chunks = max(1, min(slots, len(prompts)))
    bounds = [round(i * len(prompts) / n_chunks) for i in range(n_chunks + 1)]
    slot = 0
    for lo, hi in zip(bounds, bounds[1:]):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            t0 = time.monotonic()
            done = _run_slot(llm, name, arm, arms[arm], prompts[lo:hi], units[lo:hi], slot,
                             params)
            seconds[slot] = time.monotonic() - t0
            keep(done)
            slot += 1
    return records, seconds
