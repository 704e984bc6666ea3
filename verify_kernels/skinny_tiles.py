"""Tile choice for the few-row matmul (skinny_gemm.py): the candidate tiles, timing them on
first use of a shape, and the record of what was chosen (`TileChoices`), which the CUDA graph
runner reads and overrides when it re-times the candidates inside the whole captured step
(`recording_keys`, `candidates`, `set_config`).

A key is (rows rounded up to a power of two, N, K, dtypes, and which prologue and epilogue the
call has); each key is timed once per TileChoices, never while a CUDA graph is being captured.
The model owns its TileChoices (models/llama.py's FusedKernels) and passes it to every matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from verify_kernels.pdl import interpreting

# (BLOCK_N, BLOCK_K, num_warps, num_stages, kind) tried per shape on the GPU. Kinds:
# - "fma": FMAs, which allow narrow column tiles (more programs in flight for tall-K layers);
#   with several rows they hold BLOCK_M * BLOCK_N * BLOCK_K products, so K tiles shrink;
# - "dot": tensor-core dots of the 16-row x tile against the weight tile (16 columns or more);
# - "swap": the same dots with the operands swapped, out^T = W x^T: the weight tile is the
#   wide operand, which on Hopper lets a 64-column tile feed a warpgroup MMA straight from
#   shared memory; the prologue stays folded in, as with FMAs.
# Split-K tiles (K in 2 or 4 parts, the last part per column tile adding them up) were tried
# and not kept: the tuner picked them for one 4-row shape only, and steps were no faster
# (bench/results/gpu_verify_attn_h200_20261130_split.json).
Config = tuple  # (int, int, int, int, str)
FMA_MAX_ROWS = 8
# Two-column tiles at one row: per layer in 32-layer graphs on the H200, Qwen2.5-7B's down
# (K = 18944) took 35.3 us against 42.5 with the best tile before, o_proj 9.9 against 10.9,
# gate_up 64.4 against 64.9; no tensor-core tile beat them at one row
# (bench/results/gpu_tiles_qwen_h200_20261201.json).
CONFIGS_ONE_ROW = ((2, 1024, 4, 3, "fma"), (4, 1024, 4, 3, "fma"), (8, 512, 4, 3, "fma"),
                   (8, 1024, 4, 2, "fma"), (16, 512, 4, 3, "fma"), (16, 1024, 8, 2, "fma"),
                   (32, 256, 4, 4, "fma"), (32, 512, 8, 3, "fma"))
CONFIGS_FMA_ROWS = ((4, 256, 4, 3, "fma"), (8, 128, 4, 4, "fma"), (16, 128, 8, 3, "fma"))
# Of the tensor-core tiles, per layer in 32-layer graphs at 2 to 8 rows on the H200
# (bench/results/gpu_tiles_h200_20261201.json): 32 columns with a 6-deep pipeline won the
# 4096-column layers (o_proj 12.4 against 13.0 us for the best tile before, down 31.7 / 33.3),
# 64-column swapped tiles 6 deep the 6144-column qkv; (64, 512, 4, 2) swapped never fitted.
CONFIGS_DOT = ((16, 256, 4, 4, "dot"), (32, 256, 4, 4, "dot"), (32, 256, 4, 6, "dot"),
               (32, 512, 8, 3, "dot"), (64, 256, 8, 3, "dot"), (64, 128, 4, 4, "dot"),
               (128, 128, 8, 3, "dot"))
CONFIGS_SWAP = ((64, 64, 4, 8, "swap"), (64, 128, 4, 4, "swap"), (64, 128, 4, 6, "swap"),
                (64, 128, 4, 8, "swap"), (64, 256, 4, 3, "swap"), (64, 256, 4, 4, "swap"),
                (128, 128, 4, 4, "swap"), (128, 128, 8, 3, "swap"))
_INTERPRET_CONFIG = (32, 64, 4, 1)


def configs_for(rows: int) -> tuple[Config, ...]:
    """The candidates at `rows` rows."""
    if rows == 1:
        return CONFIGS_ONE_ROW
    return CONFIGS_DOT + (CONFIGS_FMA_ROWS if rows <= FMA_MAX_ROWS else ()) + CONFIGS_SWAP


class TileChoices:
    """The tile chosen per key, and the configs that ran when it was chosen. `tune`: time the
    candidates on a key's first use (False: take them in order, untimed; the kernel tests on
    the GPU do, to skip the timing compiles)."""

    def __init__(self, tune: bool = True) -> None:
        self.tune = tune
        self._chosen: dict[tuple, Config] = {}
        self._ran: dict[tuple, list[Config]] = {}  # per key, the configs that ran
        self._seen: list[tuple] | None = None  # keys launched inside `recording_keys`

    def choose(self, key: tuple, rows: int, launch: Callable, out: torch.Tensor,
               residual: torch.Tensor | None, device: torch.device) -> Config:
        """The config for `key`, timed among configs_for(rows) by `launch(cfg, out, residual)`
        on first use (a default, not remembered, when that falls inside a CUDA graph
        capture)."""
        cfg = self._chosen.get(key)
        if cfg is None:
            configs = configs_for(rows)
            ran = _tune(launch, configs, out, residual, device, rows == 1, self.tune)
            if ran is None:  # capturing a CUDA graph: no timing now, and nothing remembered
                return configs[1]
            cfg, self._ran[key] = ran[0], ran
            self._chosen[key] = cfg
        return cfg

    def record(self, key: tuple) -> None:
        if self._seen is not None and key not in self._seen:
            self._seen.append(key)

    def forget(self) -> None:
        """Drops every choice (the next call of each shape times its candidates again)."""
        self._chosen.clear()
        self._ran.clear()

    def chosen_configs(self) -> dict[tuple, Config]:
        return dict(self._chosen)

    @contextlib.contextmanager
    def recording_keys(self) -> Iterator[list[tuple]]:
        """Collects the config keys of every skinny_linear call made inside the block with
        these choices, in order."""
        keys: list[tuple] = []
        self._seen = keys
        try:
            yield keys
        finally:
            self._seen = None

    def candidates(self, key: tuple) -> list[Config]:
        """The configs that ran for `key` when it was tuned (fastest alone first)."""
        return list(self._ran.get(key, ()))

    def config_of(self, key: tuple) -> Config | None:
        return self._chosen.get(key)

    def set_config(self, key: tuple, cfg: Config) -> None:
        self._chosen[key] = cfg


def _tune(launch, configs, out: torch.Tensor, residual: torch.Tensor | None,
          device: torch.device, one_row: bool, timed: bool = True) -> list[Config] | None:
    """The configs that ran, fastest first, timed on scratch outputs (the residual must not
    accumulate); None while a CUDA graph is being captured. Off the GPU: one small tile, FMAs
    at one row, dots past it. Without `timed`, all of them untimed, in order."""
    if interpreting() or device.type != "cuda":
        return [(*_INTERPRET_CONFIG, "fma" if one_row else "dot")]
    if torch.cuda.is_current_stream_capturing():
        return None
    if not timed:
        return list(configs)
    from triton.testing import do_bench

    scratch = torch.empty_like(out)
    res = residual.clone() if residual is not None else None
    timed_cfgs = []
    for cfg in configs:
        try:
            timed_cfgs.append((do_bench(lambda cfg=cfg: launch(cfg, scratch, res), warmup=5,
                                        rep=20), cfg))
        except Exception:  # a config this GPU cannot fit (shared memory, registers)
            continue
    return [cfg for _, cfg in sorted(timed_cfgs)] or [configs[1]]
