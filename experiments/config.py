"""Experiment definitions: what an experiment file or an admin call declares, validated once.

Every error is a ValueError whose message starts with the path of the field at fault
(`experiments[0].arms.ngram.num_speculative_tokens: must be in [0, 64], got 99`), so that the
server can answer it as a 400 naming the field and `specdec serve` can refuse a bad file before
it loads the model. An arm's speculation goes through `drafters.check_speculative`, the check the
server applies to a request's own `speculative` field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from drafters import check_speculative

DESIGNS = ("request", "switchback")
STATES = ("active", "paused", "stopped")
# Names travel in URL paths, in the X-Specdec-Arm header ("EXPERIMENT/ARM") and in Prometheus
# labels: letters, digits, '_', '-' and '.' keep all three unambiguous.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_ARMS = 16
DEFAULT_SLOT_SECONDS = 300.0
DEFAULT_BURN_IN_SECONDS = 30.0
MAX_SLOT_SECONDS = 1e7  # ~4 months: slot arithmetic stays exact in floats
KEYS = ("name", "description", "arms", "control", "weights", "design", "slot_seconds",
        "burn_in_seconds", "state", "started_at")


@dataclass(frozen=True)
class Experiment:
    """One experiment. `weights` are normalised to sum to 1, in `arms` order. Under design
    "switchback" the whole server runs one arm per slot of `slot_seconds` from `started_at`;
    requests finishing in a slot's first `burn_in_seconds` are kept but excluded."""

    name: str
    arms: dict[str, dict[str, Any]]
    control: str
    weights: dict[str, float]
    design: str = "request"
    slot_seconds: float = DEFAULT_SLOT_SECONDS
    burn_in_seconds: float = DEFAULT_BURN_IN_SECONDS
    state: str = "active"
    started_at: float | None = None  # unix seconds; fixed when first served, then persisted
    description: str = ""
    arm_names: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        # Sorted, not as listed: assignment maps hashes onto arms in this order, and it must
        # not change when a file is reordered or a definition comes back from JSON.
        object.__setattr__(self, "arm_names", tuple(sorted(self.arms)))

    @property
    def active(self) -> bool:
        return self.state == "active"

    def with_state(self, state: str) -> Experiment:
        if state not in STATES:
            raise ValueError(f"state: must be one of {', '.join(STATES)}, got {state!r}")
        return replace(self, state=state)

    def started(self, now: float) -> Experiment:
        return self if self.started_at is not None else replace(self, started_at=now)

    def to_dict(self) -> dict[str, Any]:
        """The definition as `parse_experiment` reads it back (what the store saves)."""
        d: dict[str, Any] = {"name": self.name, "arms": {k: dict(v) for k, v in self.arms.items()},
                             "control": self.control, "weights": dict(self.weights),
                             "design": self.design, "state": self.state,
                             "started_at": self.started_at}
        if self.design == "switchback":
            d["slot_seconds"] = self.slot_seconds
            d["burn_in_seconds"] = self.burn_in_seconds
        if self.description:
            d["description"] = self.description
        return d

    def same_design(self, other: Experiment) -> bool:
        """Whether `other` is this experiment with at most its state and start time changed:
        records of a changed design must not be pooled under one name."""
        a, b = self.to_dict(), other.to_dict()
        for d in (a, b):
            for k in ("state", "started_at", "description"):
                d.pop(k, None)
        return a == b


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _name(v: Any, path: str) -> str:
    if not isinstance(v, str) or not NAME_RE.match(v):
        raise _fail(path, "must be 1-64 characters of letters, digits, '_', '-' or '.', "
                    f"starting with a letter or digit; got {json.dumps(v)[:40]}")
    return v


def _number(v: Any, path: str, *, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0 or (positive and v == 0):
        raise _fail(path, f"must be a {'positive' if positive else 'non-negative'} number; "
                    f"got {json.dumps(v)[:40]}")
    return float(v)


def _arm(spec: Any, path: str) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise _fail(path, 'must be a speculative object such as {"method": "ngram", '
                    '"num_speculative_tokens": 4} or {"method": "none"}')
    aliased = "k" in spec  # a file's shorthand for num_speculative_tokens
    if aliased:
        if "num_speculative_tokens" in spec:
            raise _fail(f"{path}.k", "give k or num_speculative_tokens, not both")
        spec = {("num_speculative_tokens" if key == "k" else key): v for key, v in spec.items()}
    try:
        check_speculative(spec)
    except ValueError as exc:
        # "speculative.KEY must be ..." -> "PATH.KEY: must be ..."
        msg = str(exc)
        head, _, rest = msg.partition(" ")
        if head.startswith("speculative."):
            key = head[len("speculative."):]
            if aliased and key == "num_speculative_tokens":
                key = "k"
            raise _fail(f"{path}.{key}", rest) from None
        if msg.startswith("unknown speculative method"):
            raise _fail(path + ".method", msg) from None
        raise _fail(path, msg) from None
    return dict(spec)


def parse_experiment(d: Any, prefix: str = "") -> Experiment:
    """One definition (a dict from YAML, JSON or an admin call) as an `Experiment`; `prefix` is
    the definition's own path in error messages (e.g. "experiments[0]")."""
    if not isinstance(d, dict):
        raise _fail(prefix or "experiment", "must be an object with 'name' and 'arms'")
    for key in d:
        if key not in KEYS:
            raise _fail(_join(prefix, str(key)), f"unknown field (known: {', '.join(KEYS)})")
    name = _name(d.get("name"), _join(prefix, "name"))
    arms_path = _join(prefix, "arms")
    raw_arms = d.get("arms")
    if not isinstance(raw_arms, dict) or not 2 <= len(raw_arms) <= MAX_ARMS:
        raise _fail(arms_path, f"must map 2 to {MAX_ARMS} arm names to speculative objects")
    arms = {_name(k, f"{arms_path}.{k}"): _arm(v, f"{arms_path}.{k}")
            for k, v in raw_arms.items()}
    control = d.get("control", next(iter(arms)))
    if control not in arms:
        raise _fail(_join(prefix, "control"), f"must be one of the arms ({', '.join(arms)}); "
                    f"got {json.dumps(control)[:40]}")
    design = d.get("design", "request")
    if design not in DESIGNS:
        raise _fail(_join(prefix, "design"), f"must be one of {', '.join(DESIGNS)}; "
                    f"got {json.dumps(design)[:40]}")
    weights = _weights(d.get("weights"), arms, _join(prefix, "weights"), design)
    slot, burn = DEFAULT_SLOT_SECONDS, DEFAULT_BURN_IN_SECONDS
    for key in ("slot_seconds", "burn_in_seconds"):
        if key in d and design != "switchback":
            raise _fail(_join(prefix, key), "only for design switchback")
    if design == "switchback":
        slot = _number(d.get("slot_seconds", slot), _join(prefix, "slot_seconds"), positive=True)
        if not 1.0 <= slot <= MAX_SLOT_SECONDS:
            raise _fail(_join(prefix, "slot_seconds"), f"must be in [1, {MAX_SLOT_SECONDS:g}] "
                        f"seconds; got {slot:g}")
        burn = _number(d.get("burn_in_seconds", min(burn, slot / 2)),
                       _join(prefix, "burn_in_seconds"), positive=False)
        if burn >= slot:
            raise _fail(_join(prefix, "burn_in_seconds"),
                        f"must be shorter than slot_seconds ({slot:g}); got {burn:g}")
    state = d.get("state", "active")
    if state not in STATES:
        raise _fail(_join(prefix, "state"), f"must be one of {', '.join(STATES)}; "
                    f"got {json.dumps(state)[:40]}")
    started = d.get("started_at")
    if started is not None:
        started = _number(started, _join(prefix, "started_at"), positive=False)
    desc = d.get("description", "")
    if not isinstance(desc, str) or len(desc) > 1000:
        raise _fail(_join(prefix, "description"), "must be a string of at most 1000 characters")
    return Experiment(name=name, arms=arms, control=control, weights=weights, design=design,
                      slot_seconds=slot, burn_in_seconds=burn, state=state, started_at=started,
                      description=desc)


def _weights(raw: Any, arms: dict[str, Any], path: str, design: str) -> dict[str, float]:
    if raw is None:
        return {a: 1.0 / len(arms) for a in arms}
    if not isinstance(raw, dict):
        raise _fail(path, "must map every arm to a positive number")
    for k in raw:
        if k not in arms:
            raise _fail(f"{path}.{k}", f"is not an arm ({', '.join(arms)})")
    missing = [a for a in arms if a not in raw]
    if missing:
        raise _fail(f"{path}.{missing[0]}", "missing: give every arm a weight")
    w = {a: _number(raw[a], f"{path}.{a}", positive=True) for a in arms}
    if design == "switchback" and len(set(w.values())) > 1:
        # Slots come in balanced blocks (one per arm, in random order): unequal shares would
        # need unbalanced blocks, and then slot order would confound time with arm.
        raise _fail(path, "switchback gives every arm an equal share of slots: leave weights "
                    "out or make them equal")
    total = sum(w.values())
    if not math.isfinite(total):
        raise _fail(path, "weights too large: their sum must be a finite number")
    return {a: v / total for a, v in w.items()}


def parse_experiments(doc: Any) -> list[Experiment]:
    """A file's document: `{"experiments": [...]}` or a bare list of definitions."""
    if isinstance(doc, dict) and set(doc) == {"experiments"}:
        items, prefix = doc["experiments"], "experiments"
    elif isinstance(doc, list):
        items, prefix = doc, "experiments"
    else:
        raise _fail("experiments", "the file must hold a list of experiments, or an object "
                    "whose only key 'experiments' holds one")
    if not isinstance(items, list):
        raise _fail(prefix, "must be a list of experiment objects")
    out = [parse_experiment(d, f"{prefix}[{i}]") for i, d in enumerate(items)]
    seen: set[str] = set()
    for i, e in enumerate(out):
        if e.name in seen:
            raise _fail(f"{prefix}[{i}].name", f"duplicate experiment name {e.name!r}")
        seen.add(e.name)
    return out


def load_experiments(path: str | Path) -> list[Experiment]:
    """Read an experiment file: JSON for `.json`, else YAML (a superset of JSON)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if p.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{p}: not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{p}: not valid YAML: {exc}") from None
    return parse_experiments(doc)
