"""Pieces shared by the command-line parsers (`specdec generate`, `serve`, `train-drafter`)."""

from __future__ import annotations

import argparse


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
                   choices=["auto", "portable", "avx512", "amx"],
                   help="CPU kernels for quantized weights and attention; 'auto' times them "
                        "on first use (all give identical results)")
