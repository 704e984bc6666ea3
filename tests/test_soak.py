"""A reduced bench/soak.py in CI: a few hundred mixed, cancelled and malformed requests against
a live server on a tiny random model; no 5xx, no malformed request accepted, greedy probes the
same as alone, no KV block left in use, the server healthy after."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest_server import REPO, ServerProcess, make_tiny_model

sys.path.insert(0, str(REPO / "bench"))

import soak


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    srv = ServerProcess(["--model", str(model), "--dtype", "float32", "--device", "cpu",
                         "--max-num-seqs", "8", "--speculative", "ngram"])
    yield from srv.serving(tmp_path_factory.mktemp("logs") / "soak.log")


def test_reduced_soak(server: ServerProcess, tmp_path: Path) -> None:
    assert server.proc is not None
    report = asyncio.run(soak.soak(server.url, 240, concurrency=8, seed=1,
                                   pid=server.proc.pid, max_tokens=16, max_seconds=300))
    assert report["5xx"] == 0, report
    assert report["malformed_accepted"] == 0, report
    assert report["probe_mismatches"] == [], report["probe_mismatches"][:3]
    assert report["kv_blocks_used_after"] == 0 and report["running_after"] == 0, report
    assert report["health_after"] == 200
    assert report["outcomes"].get("ok", 0) > 100 and report["outcomes"].get("cancelled", 0) > 20
    assert "skipped (time limit)" not in report["outcomes"], report
