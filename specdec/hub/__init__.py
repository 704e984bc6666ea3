"""Model resolution: preset names, HF directories and GGUF files -> a local HF-style directory."""

from __future__ import annotations

from specdec.hub.fetch import ChecksumError
from specdec.hub.presets import PRESETS, Preset, WheelPart
from specdec.hub.resolve import cache_root, default_draft_for, pull, resolve_model_path

__all__ = [
    "PRESETS",
    "ChecksumError",
    "Preset",
    "WheelPart",
    "cache_root",
    "default_draft_for",
    "pull",
    "resolve_model_path",
]
