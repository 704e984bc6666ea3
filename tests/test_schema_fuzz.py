"""schemathesis against the live server's /openapi.json with every check it has (as `st run
--checks all`), bounded: its phases (examples, coverage, fuzzing, stateful) generate requests from
the schema, valid and not, and check each response against the schema (status, content type,
headers, body), that valid requests are accepted and invalid ones rejected, that a method a path
does not take is a 405 with Allow, that auth is enforced where the schema says, and more; on top,
no 5xx and every error body an OpenAI error object."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest_server import ServerProcess, make_tiny_model

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import CHECKS, load_all_checks  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.core.failures import Failure  # noqa: E402
from schemathesis.engine import Status, events  # noqa: E402
from schemathesis.specs.openapi.checks import RejectedPositiveData  # noqa: E402

from server.openapi import Served, openapi_schema  # noqa: E402

EXAMPLES = 12  # per operation, phase and mode
KEY = "fuzz-key"
SEED = 20240527  # one fixed run: a failure reproduces
# schemathesis leaves out the operation that serves the schema it loaded (GET /openapi.json).
LABELS = [f"{method.upper()} {path}" for path, ops in openapi_schema(Served(
    "tiny", auth=True, experiments=True))["paths"].items()
    for method in ops if method in ("get", "post", "put", "delete", "patch")
    and path != "/openapi.json"]

# Constraints a valid request must meet that JSON Schema (of OpenAPI 3.0) cannot state; the
# schema says them in descriptions. A valid request rejected with 400 (or 413) for one of these
# exact reasons, as the error's param and message give it, is no failure of positive data
# acceptance: (part of the param, message fragment, operation or None for any).
UNSTATED = [
    ("", "maximum context length", None),  # the prompt's length is in tokens
    (".min_n", "must not exceed", None),  # min_n <= max_n
    (".survival", "non-increasing", None),
    ("control", "must be one of the arms", "POST /v1/experiments"),
    ("weights", "", "POST /v1/experiments"),  # keyed by the arms; equal under switchback
    ("burn_in_seconds", "shorter than slot_seconds", "POST /v1/experiments"),
    ("", "must be 1-64 characters", "POST /v1/experiments"),  # an arm's name (propertyNames)
]


def _unstated(failure: Failure, case: Any, response: Any) -> bool:
    if not isinstance(failure, RejectedPositiveData) or response.status_code not in (400, 413):
        return False
    try:
        err = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    param, message = err.get("param") or "", err.get("message") or ""
    label = case.operation.label
    return any(p in param and fragment in message and op in (None, label)
               for p, fragment, op in UNSTATED)


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx but a 499 (the client left: nobody reads it) is an OpenAI error."""
    if response.status_code < 400 or response.status_code == 499:
        return None
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["type"], response.text[:500]
    assert {"param", "code"} <= set(err), response.text[:500]
    return None


@dataclass
class Run:
    failures: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    checked: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    cases: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    # A short context bounds the work of any one generated request.
    srv = ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--dtype",
                         "float32", "--device", "cpu", "--max-model-len", "64",
                         "--max-num-seqs", "8", "--speculative", "ngram", "--api-key", KEY])
    yield from srv.serving(tmp_path_factory.mktemp("logs") / "fuzz.log")


@pytest.fixture(scope="module")
def fuzz_run(fuzz_server: ServerProcess) -> Run:
    config = SchemathesisConfig.from_dict({
        "seed": SEED, "workers": 1, "continue-on-failure": True, "request-timeout": 60,
        "generation": {"max-examples": EXAMPLES, "database": "none"},
        "auth": {"openapi": {"bearer": {"bearer": KEY}, "dashboard_key": {"api_key": KEY}}},
    })
    config.projects.override.checks.update(included_check_names=["all"])
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)

    @schema.hook
    def filter_failure(context: Any, failure: Failure, case: Any, response: Any) -> bool:
        return not _unstated(failure, case, response)

    run = Run()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, nodes in event.recorder.checks.items():
                node = event.recorder.cases.get(case_id)
                label = node.value.operation.label if node is not None else event.recorder.label
                run.cases[label] += 1
                for check in nodes:
                    run.checked[label].add(check.name)
                    if check.status is Status.FAILURE and check.failure_info is not None:
                        f = check.failure_info.failure
                        run.failures[label].append(
                            f"[{check.name}, {event.phase.name.lower()}] {f.title}: "
                            f"{f.message}\n{check.failure_info.code_sample}")
        elif isinstance(event, events.NonFatalError):
            run.errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            run.errors.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            run.errors += [f"after the run: {f.title}: {f.message}" for f in event.failures]
    return run


def _report(lines: list[str], limit: int = 8) -> str:
    unique = list(dict.fromkeys(lines))
    more = f"\n... and {len(unique) - limit} more" if len(unique) > limit else ""
    return "\n\n".join(unique[:limit]) + more


@pytest.mark.parametrize("label", LABELS)
def test_operation_conforms(fuzz_run: Run, label: str) -> None:
    assert fuzz_run.cases[label] > 0, f"{label}: no request was generated"
    assert not fuzz_run.failures[label], _report(fuzz_run.failures[label])


def test_every_check_ran_without_errors(fuzz_run: Run) -> None:
    assert not fuzz_run.errors, "\n".join(fuzz_run.errors)
    load_all_checks()
    ran = set().union(*fuzz_run.checked.values())
    missing = set(CHECKS.get_all_names()) - ran
    assert not missing, "checks that never ran: " + ", ".join(sorted(missing))
    others = {label: f for label, f in fuzz_run.failures.items() if label not in LABELS}
    assert not others, _report([line for f in others.values() for line in f])
