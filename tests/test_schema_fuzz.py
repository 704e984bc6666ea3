"""schemathesis against the live server's /openapi.json, bounded: requests generated from the
schema (valid and not) never get a 5xx, and every error body is an OpenAI error object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest_server import ServerProcess, make_tiny_model

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server.openapi import openapi_schema  # noqa: E402

EXAMPLES = 12  # per operation and mode
LABELS = [f"{method.upper()} {path}" for path, ops in openapi_schema("tiny")["paths"].items()
          for method in ops if method in ("get", "post", "put", "delete", "patch")]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    # A short context bounds the work of any one generated request.
    srv = ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--dtype",
                         "float32", "--device", "cpu", "--max-model-len", "64",
                         "--max-num-seqs", "8", "--speculative", "ngram"])
    yield from srv.serving(tmp_path_factory.mktemp("logs") / "fuzz.log")


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def check(case: Any) -> None:
    r = case.call(timeout=60)
    assert r.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {r.status_code} " \
                                f"{r.text[:500]}"
    if r.status_code >= 400 and r.status_code != 499:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"], r.text[:500]
        assert {"param", "code"} <= set(err), r.text[:500]


@pytest.mark.parametrize("label", LABELS)
def test_no_server_error_and_openai_error_bodies(api_schema: Any, label: str) -> None:
    op = api_schema.find_operation_by_label(label)
    assert op is not None, f"{label} is not in the served schema"
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @given(op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            check(case)

        try:
            run()
        except Unsatisfiable:  # nothing to make invalid: an operation without parameters
            assert mode is GenerationMode.NEGATIVE
