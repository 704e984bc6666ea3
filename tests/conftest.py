from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_model

# The tests run tiny models: one thread avoids thread hand-off costs that dominate small ops
# (and that balloon when two test processes share the two cores of a CI machine).
torch.set_num_threads(1)
# CUDA graph tuning is not read from or kept in the user's cache (the test of that cache sets
# its own); every test tunes what it captures.
os.environ["SPECDEC_TUNING_CACHE"] = "0"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "llama", vocab_size=64)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft"), "llama", vocab_size=64, layers=1,
                      seed=1)
