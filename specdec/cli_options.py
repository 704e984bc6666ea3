"""Pieces shared by the command-line parsers (`specdec generate`, `serve`, `train-drafter`),
and the one reader of the engine's environment variables (`runtime_from_env`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch, which the config imports, is not needed for a parser's --help
    from specdec.config import RuntimeConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, options without help text too."""

    def add_argument(self, action: argparse.Action) -> None:
        if not action.help and action.option_strings and action.default not in (
                None, argparse.SUPPRESS, False):
            action.help = "(default: %(default)s)"  # argparse prints nothing for no help
        super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS, False):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            text = (text.strip() + " (default: %(default)s)").strip()
        return text


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """--quantization and --cpu-kernel, shared by `generate` and `serve`."""
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int4", "int8"],
                   help="GGUF weights: 'auto' keeps them quantized as the file holds them (CPU), "
                        "'int4'/'int8' converts every weight to that kind, 'none' dequantizes "
                        "to --dtype (the exact float path)")
    p.add_argument("--cpu-kernel", default="auto",
                   choices=["auto", "portable", "avx2", "avx512", "amx"],
                   help="CPU kernels for quantized weights and attention; 'auto' times them "
                        "on first use (all give identical results)")


def runtime_from_env(env: Mapping[str, str] | None = None, **fields: Any) -> RuntimeConfig:
    """The RuntimeConfig the environment asks for (`env`, default os.environ), with `fields`
    (RuntimeConfig's, from command-line flags) on top:
    - SPECDEC_TUNE_GRAPHS=0: no timing of split counts and tiles per CUDA graph bucket;
    - SPECDEC_TUNE_CONTEXT=N: the tuning's placeholder step reads N cached tokens (1024);
    - SPECDEC_TUNING_CACHE=0: tuned choices neither read from nor kept on disk;
    - SPECDEC_PDL=1: programmatic dependent launch (Hopper and later);
    - SPECDEC_SKINNY_TUNE=0: the few-row matmul takes its first tile candidate, untimed.
    A malformed SPECDEC_TUNE_CONTEXT exits with a message."""
    from specdec.config import RuntimeConfig

    env = os.environ if env is None else env
    raw = env.get("SPECDEC_TUNE_CONTEXT", "1024")
    if not raw.strip().isdigit():
        raise SystemExit(f"SPECDEC_TUNE_CONTEXT must be a number of tokens (>= 0), got {raw!r}")
    values: dict[str, Any] = {
        "tune_graphs": env.get("SPECDEC_TUNE_GRAPHS", "1") != "0",
        "tune_context": int(raw),
        "tuning_cache": env.get("SPECDEC_TUNING_CACHE", "1") != "0",
        "pdl": env.get("SPECDEC_PDL", "0") == "1",
        "skinny_tune": env.get("SPECDEC_SKINNY_TUNE", "1") != "0",
    }
    return RuntimeConfig(**{**values, **fields})
