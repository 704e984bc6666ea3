"""Build a model from an HF config and fill it from safetensors (or random, for "dummy")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from specdec.models.heap import release_freed_memory
from specdec.models.llama import ARCHITECTURES, FusedKernels, LlamaForCausalLM

# HF checkpoint name -> (our parameter name, shard index within a fused weight).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                     f"supported: {', '.join(sorted(ARCHITECTURES))}")


@contextmanager
def _skip_init() -> Iterator[None]:
    """Build modules without drawing their initial weights: every weight is loaded or drawn
    later. (Building on the meta device instead would run PyTorch's Python reference ops, which
    import torch._dynamo, and with it Triton, into a CPU-only process.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def gguf_source(path: str | Path | None) -> Path | None:
    """The GGUF file a converted model directory takes its weights from, if it is one."""
    if path is None:
        return None
    src = Path(path) / "specdec_source.json"
    if not src.is_file():
        return None
    meta = json.loads(src.read_text())
    if meta.get("weights") != "gguf":
        return None  # an older conversion that wrote float32 safetensors beside it
    gguf = Path(meta["gguf"])
    if not gguf.is_file():
        raise FileNotFoundError(f"{path} takes its weights from {gguf}, which no longer exists")
    return gguf


def build_model(hf: dict[str, Any], path: str | None, dtype: torch.dtype,
                device: torch.device, load_format: str = "auto", quantization: str = "none",
                cpu_kernel: str = "auto", pdl: bool = False,
                skinny_tune: bool = True) -> LlamaForCausalLM:
    """quantization: "none" loads float weights of `dtype`; otherwise (a GGUF source on the CPU)
    the linear layers and embeddings stay quantized (specdec/models/gguf_weights.py). `pdl`,
    `skinny_tune`: the fused path's kernel settings (RuntimeConfig's fields of those names)."""
    arch = architecture_of(hf)
    with _skip_init():  # uninitialised CPU memory: no page is touched until a weight lands
        model = LlamaForCausalLM(hf, ARCHITECTURES[arch])
    gguf = gguf_source(path) if load_format == "auto" else None
    if gguf is not None and quantization != "none":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("quantized weights run on the CPU with float32 activations; "
                             "use quantization='none' for other devices and dtypes")
        from specdec.models.quant_model import load_quantized

        model = load_quantized(model, gguf, quantization, cpu_kernel)
        _init_rope(model, hf, device)
        release_freed_memory()
        return model.eval()
    model = model.to_empty(device=device).to(dtype)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _init_rope(model, hf, device)
    if load_format == "dummy":
        _init_random(model)
    elif load_format == "auto":
        if path is None:
            raise ValueError("a model path is needed to load weights")
        if gguf is not None:
            from specdec.models.gguf_weights import load_tensors

            load_weights(model, load_tensors(gguf, hf, "none"), str(gguf))
        else:
            load_weights(model, _tensors(Path(path)), str(path))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if _can_fuse(model, device):
        model.kernels = fused_kernels(pdl, skinny_tune)
    return model.eval()


def fused_kernels(pdl: bool = False, skinny_tune: bool = True) -> FusedKernels:
    """The settings that switch a model onto the fused Triton path (`model.kernels`)."""
    from verify_kernels.skinny_tiles import TileChoices

    return FusedKernels(TileChoices(tune=skinny_tune), pdl=pdl)


def _init_rope(model: LlamaForCausalLM, hf: dict[str, Any], device: torch.device) -> None:
    from specdec.models.rope import inverse_frequencies

    head_dim = model.model.rotary.inv_freq.numel() * 2
    inv, _ = inverse_frequencies(head_dim, hf)
    model.model.rotary.inv_freq = inv.to(device)


def _can_fuse(model: LlamaForCausalLM, device: torch.device) -> bool:
    """The fused GPU kernels need CUDA, Triton, full rotary and a power-of-two half head."""
    if device.type != "cuda":
        return False
    try:
        import verify_kernels.fused_ops  # noqa: F401
    except ImportError:
        return False
    attn = model.model.layers[0].self_attn
    half = attn.head_dim // 2
    return model.model.rotary.rot_dim == attn.head_dim and half & (half - 1) == 0


@torch.no_grad()
def _init_random(model: LlamaForCausalLM, std: float = 0.02) -> None:
    # Drawn where the weights live: on the CPU an 8B model would take minutes.
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for f in files:
        with safe_open(str(path / f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, Any]], source: str
                 ) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            # GGUF-converted checkpoints may store a copy of the tied output layer.
            continue
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[target]
        if shard is None:
            param.copy_(tensor)
        else:
            sizes = _shard_sizes(model, target)
            start = sum(sizes[:shard])
            param.narrow(0, start, sizes[shard]).copy_(tensor)
        loaded.add(f"{target}#{shard}")
    missing = [n for n in params if not _covered(n, loaded, model)]
    if missing:
        raise ValueError(f"checkpoint {source} lacks weights for: {missing[:8]}")


def _shard_sizes(model: LlamaForCausalLM, target: str) -> list[int]:
    attn = model.model.layers[0].self_attn
    if "qkv_proj" in target:
        return [attn.q_size, attn.kv_size, attn.kv_size]
    inter = model.model.layers[0].mlp.inter
    return [inter, inter]


def _covered(name: str, loaded: set[str], model: LlamaForCausalLM) -> bool:
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return True
    if "qkv_proj" in name:
        return all(f"{name}#{i}" in loaded for i in range(3))
    if "gate_up_proj" in name:
        return all(f"{name}#{i}" in loaded for i in range(2))
    return f"{name}#None" in loaded
