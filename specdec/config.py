"""The engine's frozen configuration tree.

`EngineConfig` composes the sub-configs; `resolve_config` fills in every derived value (paths,
architecture facts, eos ids, block count) once and returns a new, final config. Nothing mutates a
config after that; each component receives only its own sub-config. `engine_config_from_args`
sorts the flat keyword arguments of the Python API and the CLI into that tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    model: str  # preset name, HF directory or .gguf file
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "auto"  # "auto" | "dummy" (random weights from config.json alone)
    max_model_len: int | None = None
    # "auto": a GGUF's weights stay quantized as the file holds them (on the CPU, float32
    # activations), other sources load as `dtype`; "int4" / "int8": every GGUF weight in that
    # kind; "none": dequantized to `dtype` (the exact float path). Resolved to one of
    # "none" | "auto" | "int4" | "int8" by resolve_model_config.
    quantization: str = "auto"
    # CPU kernels for quantized weights and attention: "auto" (the fastest measured per row
    # count), or one of "portable", "avx2", "avx512", "amx" (identical results; a test forces
    # them).
    cpu_kernel: str = "auto"
    # Filled in by resolve_config:
    path: str | None = None  # resolved local HF-style directory
    hf_config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(c.get("num_key_value_heads") or c["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.85  # fraction of free device memory for KV on CUDA
    cpu_kv_bytes: int = 512 << 20  # KV budget on the CPU (9k tokens of the 1.5b preset)
    # ... of which cached prefixes keep resident: beyond it the prefix cache recycles its own
    # blocks before it writes fresh ones (BlockManager.resident; requests may still use all)
    cpu_kv_resident_bytes: int = 128 << 20
    num_blocks: int | None = None  # explicit override; resolved otherwise
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decode + trees)
    max_waiting: int = 1024  # admission bound; the server answers 429 beyond it


@dataclass(frozen=True)
class RuntimeConfig:
    """How steps run on the device: switches that change speed, never outputs. Only the CLIs
    read environment variables (specdec/cli_options.py); everything else passes this."""

    # Launch the next step before reading the previous one back (LLMEngine.step: a step is
    # chained on the device from its predecessor's verdict, specdec/chaining.py). None: on
    # where the device runs asynchronously to the host (CUDA).
    overlap: bool | None = None
    # Chaining speculative steps too (drafted on the device, for drafters with position tables
    # or device lookup). None: wherever overlap is on.
    spec_overlap: bool | None = None
    cuda_graphs: bool = True  # replay fixed-shape steps from CUDA graphs (CUDA + Triton only)
    tune_graphs: bool = True  # time split counts and matmul tiles per graph bucket
    tune_context: int = 1024  # cached tokens of the placeholder step that tuning times
    tuning_cache: bool = True  # keep tuned choices on disk (specdec/graph_tuning.py)
    pdl: bool = False  # programmatic dependent launch (verify_kernels/pdl.py), Hopper and up
    skinny_tune: bool = True  # time the few-row matmul's tile candidates (False: first one)

    def __post_init__(self) -> None:
        if self.tune_context < 0:
            raise ValueError(f"tune_context must be >= 0, got {self.tune_context}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """The engine-wide default speculation; requests may override it per request."""

    method: str = "none"  # "none" | "ngram" | "draft_model" | registered drafter names
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @staticmethod
    def from_dict(spec: dict[str, Any] | None) -> SpeculativeConfig:
        if not spec:
            return SpeculativeConfig()
        spec = dict(spec)
        method = str(spec.pop("method", "ngram"))
        k = int(spec.pop("num_speculative_tokens", 4))
        draft = spec.pop("draft_model", None)
        if k < 0 or k > 64:
            raise ValueError("num_speculative_tokens must be in [0, 64]")
        return SpeculativeConfig(method=method, num_speculative_tokens=k,
                                 draft_model=draft, options=spec)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.method,
                             "num_speculative_tokens": self.num_speculative_tokens}
        if self.draft_model:
            d["draft_model"] = self.draft_model
        d.update(self.options)
        return d


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    seed: int = 0


# How deep the preset's default draft model may draft (the controller picks each step's depth up
# to it): with its chains ended by their first unsure token (drafters/draft_model.py,
# DRAFT_P_MIN), 8 deep priced best on the 2-core CPU.
DRAFT_DEPTH = 8
# The CPU's per-step token budget: a step of that many prefill tokens takes 1-3 s there.
CPU_STEP_TOKENS = 256


def engine_config_from_args(model: str, dtype: str = "float32", device: str = "cpu",
                            speculative: dict[str, Any] | None = None,
                            runtime: RuntimeConfig | None = None, **kw: Any
                            ) -> tuple[EngineConfig, str, bool]:
    """Flat keyword arguments (the Python API's and the CLI's) sorted into an EngineConfig, with
    the engine's own two: (config, attention_backend, adaptive_speculation)."""
    mc_kw = {k: kw.pop(k) for k in ("load_format", "max_model_len", "quantization",
                                    "cpu_kernel") if k in kw}
    cc_kw = {k: kw.pop(k) for k in ("block_size", "num_blocks", "cpu_kv_bytes",
                                    "cpu_kv_resident_bytes", "gpu_memory_utilization",
                                    "enable_prefix_caching") if k in kw}
    sc_kw = {k: kw.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_waiting")
             if k in kw}
    rt_kw = {k: kw.pop(k) for k in ("overlap", "spec_overlap") if k in kw}
    runtime = replace(runtime or RuntimeConfig(), **rt_kw)
    if device == "cpu" and sc_kw.get("max_num_batched_tokens") is None:
        # A CPU step computes about 100-200 tokens a second: a 2048-token step would hold
        # every other request for 10-20 s (bench/head_of_line.py).
        sc_kw["max_num_batched_tokens"] = CPU_STEP_TOKENS
    backend = kw.pop("attention_backend", "auto")
    adaptive = bool(kw.pop("adaptive_speculation", False))
    seed = kw.pop("seed", 0)
    if kw:
        raise TypeError(f"unknown engine arguments: {sorted(kw)}")
    if speculative is None:
        from specdec.hub import default_draft_for

        draft = default_draft_for(model)
        speculative = ({"method": "draft_model", "draft_model": draft,
                        "num_speculative_tokens": DRAFT_DEPTH} if draft
                       else {"method": "ngram"})
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, device=device, **mc_kw),
        cache=CacheConfig(**cc_kw), scheduler=SchedulerConfig(**sc_kw),
        speculative=SpeculativeConfig.from_dict(speculative), runtime=runtime, seed=seed)
    return cfg, backend, adaptive


def load_hf_config(path: str | Path) -> dict[str, Any]:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not an HF-style model directory")
    return json.loads(cfg_file.read_text())


def _eos_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (hf, _read_json(path / "generation_config.json")):
        eos = source.get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return tuple(ids)


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text()) if p.is_file() else {}


def resolve_model_config(mc: ModelConfig) -> ModelConfig:
    """Locate (pulling a preset if needed) and read the model; return the final ModelConfig."""
    if mc.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {mc.dtype!r}")
    from specdec.hub import resolve_model_path

    if mc.path:
        path = Path(mc.path)
    elif mc.load_format == "dummy" and (Path(mc.model) / "config.json").is_file():
        path = Path(mc.model)  # random weights: config.json and a tokenizer are enough
    else:
        path = resolve_model_path(mc.model)
    hf = load_hf_config(path)
    max_len = mc.max_model_len or int(hf.get("max_position_embeddings", 4096))
    max_len = min(max_len, 32768)
    return replace(mc, path=str(path), hf_config=hf, eos_token_ids=_eos_ids(path, hf),
                   max_model_len=max_len, quantization=_quantization(mc, path))


def _quantization(mc: ModelConfig, path: Path) -> str:
    from specdec.cpu_kernels.build import PATHS
    from specdec.models.gguf_weights import QUANTIZATIONS
    from specdec.models.loader import gguf_source

    if mc.cpu_kernel not in ("auto", *PATHS):
        raise ValueError(f"cpu_kernel must be 'auto' or one of {sorted(PATHS)}, got "
                         f"{mc.cpu_kernel!r}")
    q = mc.quantization
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {q!r}")
    from_gguf = mc.load_format == "auto" and gguf_source(path) is not None
    on_cpu_f32 = mc.device == "cpu" and mc.dtype == "float32"
    if q == "auto":
        return "auto" if from_gguf and on_cpu_f32 else "none"
    if q != "none" and not (from_gguf and on_cpu_f32):
        raise ValueError(f"quantization={q!r} needs a GGUF model on the CPU with dtype float32 "
                         f"(got {mc.model!r} on {mc.device}, {mc.dtype}); use 'none' or 'auto'")
    return q
