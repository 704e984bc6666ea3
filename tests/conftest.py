from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_model

from specdec.cli_options import runtime_from_env
from specdec.config import RuntimeConfig

# The tests run tiny models: one thread avoids thread hand-off costs that dominate small ops
# (and that balloon when two test processes share the two cores of a CI machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _draft_every_depth(monkeypatch):
    """The tiny random models' draft distributions are nearly flat (64 tokens, the top one
    rarely above 0.3), so the draft model's default `p_min` would end nearly every chain after
    its first token and leave the tests of drafting with one-token chains; they draft every
    depth asked for, and the tests of `p_min` set it."""
    import drafters.draft_model

    monkeypatch.setattr(drafters.draft_model, "DRAFT_P_MIN", 0.0)


@pytest.fixture(scope="session")
def runtime() -> RuntimeConfig:
    """The runtime switches of the engines and graph runners the tests build on CUDA: the
    SPECDEC_* variables as the CLIs read them (bench/gpu_run.sh sets SPECDEC_TUNE_GRAPHS=0 and
    SPECDEC_SKINNY_TUNE=0 to skip the timing), except that CUDA graph tuning is never read from
    or kept in the user's cache (the test of that cache sets its own): every test tunes what it
    captures."""
    return runtime_from_env(tuning_cache=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "llama", vocab_size=64)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft"), "llama", vocab_size=64, layers=1,
                      seed=1)
