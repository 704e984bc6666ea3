"""Fill an unloaded LlamaForCausalLM from a GGUF file with its weights kept quantized.

Each linear layer becomes a QuantLinear (q, k and v in one layer, gate and up in another, as the
float model fuses them), the output layer a QuantLinear over `output.weight` (or over the
embedding's table when the file ties them), and the embedding a FileEmbedding reading the file's
rows (a QuantEmbedding over that table when tied). Norms and biases are float32. No float copy
of a quantized weight is ever made.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specdec.models.cpu_layers import CpuLayers
from specdec.models.gguf_weights import FileEmbedding, GGUFTensor, load_tensors
from specdec.models.huge_pages import rehome
from specdec.models.llama import LlamaForCausalLM
from specdec.models.quant_linear import QuantEmbedding, QuantLinear, QuantWeight

log = logging.getLogger(__name__)

_PARTS = {  # our fused layer -> its HF parts, in output order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _set(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _linear(weights: dict[str, QuantWeight | torch.Tensor], biases: dict[str, torch.Tensor],
            names: tuple[str, ...], where: str, cpu_kernel: str) -> QuantLinear:
    parts = []
    for n in names:
        w = weights.pop(f"{n}.weight", None)
        if not isinstance(w, QuantWeight):
            raise ValueError(f"GGUF tensor {n}.weight is missing or cannot stay quantized "
                             f"({where}); load it with quantization='none'")
        parts.append(w)
    bs = [biases.pop(f"{n}.bias", None) for n in names]
    bias = None
    if any(b is not None for b in bs):
        bias = torch.cat([b if b is not None else torch.zeros(p.rows) for b, p in zip(bs, parts)])
    return QuantLinear(parts, bias, cpu_kernel)


@torch.no_grad()
def load_quantized(model: LlamaForCausalLM, gguf: Path, quantization: str,
                   cpu_kernel: str = "auto") -> LlamaForCausalLM:
    weights: dict[str, QuantWeight | torch.Tensor] = {}
    table: GGUFTensor | None = None  # the embedding, converted only if the output layer is it
    for name, w in load_tensors(gguf, model.hf, quantization, lazy=("model.embed_tokens.weight",)):
        if isinstance(w, GGUFTensor):
            table = w
        else:
            weights[name] = w
    biases = {k: weights.pop(k) for k in list(weights) if k.endswith(".bias")}
    for i in range(len(model.model.layers)):
        for ours, theirs in _PARTS.items():
            prefix = f"model.layers.{i}."
            layer = _linear(weights, biases, tuple(prefix + t for t in theirs), str(gguf),
                            cpu_kernel)
            _set(model, prefix + ours, layer)
    if table is None:
        raise ValueError(f"{gguf} has no token_embd.weight")
    vocab = int(model.hf["vocab_size"])
    head = weights.pop("lm_head.weight", None)
    model.tie_word_embeddings = head is None
    if head is None:  # tied: the output layer reads the embedding's table
        embed = head = table.converted(quantization)
        model.model.embed_tokens = (QuantEmbedding(embed, vocab) if isinstance(embed, QuantWeight)
                                    else nn.Embedding.from_pretrained(embed, freeze=True))
    else:
        model.model.embed_tokens = FileEmbedding(gguf, table)
    model.lm_head = (QuantLinear([head], None, cpu_kernel, vocab) if isinstance(head, QuantWeight)
                     else _float_linear(head))
    # What is left (norms, q/k norms) are float parameters still to fill.
    params = dict(model.named_parameters())
    for name, t in weights.items():
        if name not in params:
            raise ValueError(f"GGUF tensor {name!r} has no place in the model")
        params[name].copy_(t)
        del params[name]
    if params:
        raise ValueError(f"{gguf} lacks weights for: {sorted(params)[:8]}")
    if biases:
        raise ValueError(f"GGUF biases with no layer: {sorted(biases)[:8]}")
    if cpu_kernel == "auto":  # time the kernel paths now, not inside the first steps
        from specdec.cpu_kernels.build import choices, choose_path

        for rows in (1, 2, 4, 8, 16):
            choose_path(rows)
        log.info("cpu kernel path by activation rows (timed): %s", choices())
    # In memory the kernel may back with 2 MB pages, before the C layers take their pointers.
    model.weight_arena = rehome(quant_weights(model))
    model.cpu_layers = CpuLayers.of(model, cpu_kernel)
    return model


def quant_weights(model: nn.Module) -> list[QuantWeight]:
    """Every QuantWeight of a model's quantized layers and embedding, once each (a tied
    output layer shares the embedding's)."""
    unique = {id(w): w for m in model.modules()
              for w in (m.parts if isinstance(m, QuantLinear) else
                        [m.table] if isinstance(m, QuantEmbedding) else [])}
    return list(unique.values())


def _float_linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w.float(), requires_grad=False)
    return lin
