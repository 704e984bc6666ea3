"""The C run of quantized decoder layers (specdec/models/cpu_layers.py, cpu_kernels/layer_step.c)
against the PyTorch module path on the same quantized weights: a prefill, decodes and tree rows,
for Llama, Qwen2 (qkv bias) and Qwen3 (q/k norms) shapes, on every kernel build this CPU runs;
and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

import drafters  # noqa: F401  (first: the drafters and the runner import each other)
from specdec.cpu_kernels.build import available_paths
from specdec.model_runner import get_attention_backend
from specdec.models.cpu_layers import CpuLayers
from specdec.models.llama import ARCHITECTURES, LlamaForCausalLM
from specdec.models.quant_linear import QuantLinear, QuantWeight
from specdec.step_inputs import Segment, eager_inputs

BLOCK = 16


def _model(arch: str, gen: torch.Generator) -> LlamaForCausalLM:
    hf = {"vocab_size": 96, "hidden_size": 128, "intermediate_size": 192,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 512}
    flags = ARCHITECTURES[arch]
    model = LlamaForCausalLM(hf, flags)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    for i, layer in enumerate(model.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        kind = ("q4", "q5")[i % 2]  # and q8 for the o and down projections

        def quant(rows_list: list[int], k: int, bias: torch.Tensor | None = None,
                  kind: str = kind) -> QuantLinear:
            parts = [QuantWeight.random(kind, n, k, gen) for n in rows_list]
            return QuantLinear(parts, bias)

        qkv_bias = at.qkv_proj.bias.detach().clone() if at.qkv_proj.bias is not None else None
        at.qkv_proj = quant([at.q_size, at.kv_size, at.kv_size], 128, qkv_bias)
        at.o_proj = quant([128], at.q_size, kind="q8")
        mlp.gate_up_proj = quant([192, 192], 128)
        mlp.down_proj = quant([128], 192, kind="q8")
    return model


def _segments() -> list[list[Segment]]:
    """Step by step: a 20-token prefill of sequence 0, then a decode of 0 beside a 7-token
    prefill of 1, then a 4-node tree of 0 beside a decode of 1."""
    t0, t1 = list(range(1, 21)), list(range(30, 37))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    return [
        [Segment(t0, list(range(20)), list(range(20)), 0, [0, 1], logits_rows=(19,))],
        [Segment([5], [20], [20], 20, [0, 1], logits_rows=(0,)),
         Segment(t1, list(range(7)), [64 + j for j in range(7)], 0, [4], logits_rows=(6,))],
        [Segment([6, 7, 8, 9], [21, 22, 22, 23], [21, 22, 23, 24], 21, [0, 1], mask=tree,
                 logits_rows=(0, 1, 2, 3)),
         Segment([11], [7], [71], 7, [4], logits_rows=(0,))],
    ]


def _run(model: LlamaForCausalLM, backend, steps: list[list[Segment]]) -> list[torch.Tensor]:
    kv = torch.zeros(2, 2, 8, BLOCK, 2, 32)  # [L, 2, blocks, block_size, Hkv, D]
    outs = []
    for segs in steps:
        ids, pos, meta = eager_inputs(segs, torch.device("cpu"), BLOCK)
        hidden, _ = model(ids, pos, meta, kv, backend)
        outs.append(hidden)
    return outs


@pytest.mark.parametrize("path", available_paths())
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_c_layers_match_the_module_path(arch: str, path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    model = _model(arch, gen)
    backend = get_attention_backend("cpu", torch.device("cpu"), path)
    with torch.inference_mode():
        ref = _run(model, backend, _segments())
        model.cpu_layers = CpuLayers.of(model, path)
        assert model.cpu_layers is not None
        got = _run(model, backend, _segments())
    for r, g in zip(ref, got):
        # The same quantized matmuls; norms, rotary and silu round differently, and a last-bit
        # difference can move an int8 activation by one step (one seed in five or six here),
        # which moves the later layers' outputs by up to 1% of their norm: close, not equal. A
        # wrong rotary, head or norm moves them by tens of percent.
        assert float((g - r).norm() / r.norm()) < 3e-2


def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    gen = torch.Generator().manual_seed(1)
    model = _model("Qwen2ForCausalLM", gen)
    backend = get_attention_backend("cpu", torch.device("cpu"))
    model.cpu_layers = CpuLayers.of(model)
    steps = _segments()
    with torch.inference_mode():
        together = _run(model, backend, steps)
        alone = _run(model, backend, [steps[0], steps[1][:1], steps[2][:1]])
    # Sequence 0's decode and tree rows, with and without sequence 1 in the step: bit for bit.
    assert torch.equal(together[1][:1], alone[1])
    assert torch.equal(together[2][:4], alone[2])


def test_layers_it_cannot_run_stay_on_the_module_path() -> None:
    gen = torch.Generator().manual_seed(2)
    model = _model("LlamaForCausalLM", gen)
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(192, 128)
    assert CpuLayers.of(model) is None
