"""specdec: a speculative-decoding LLM inference engine.

    from specdec import LLM, SamplingParams
"""

from __future__ import annotations

from typing import Any

from specdec.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported lazily: drafters import engine parts, and the engine imports drafters.
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    if name == "LLMEngine":
        from specdec.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
