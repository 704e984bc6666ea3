"""Model registry: HF architecture name -> module class, and weight loading."""

from __future__ import annotations

from specdec.models.llama import ARCHITECTURES, LlamaForCausalLM
from specdec.models.loader import build_model

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "build_model"]
