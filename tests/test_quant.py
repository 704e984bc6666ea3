"""Quantized CPU weights: the kernels against their references, GGUF block decoding against the
gguf package's own dequantization, and a tiny quantized model end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.cpu_kernels.build import ISAS, supported
from specdec.models.gguf_weights import DIRECT, GGUFTensor, load_tensors
from specdec.models.quant_linear import (
    QuantWeight,
    kernel_order,
    quant_matmul,
    quant_matmul_ref,
    quantize_activations,
)

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
ISA_PARAMS = [pytest.param(i, marks=pytest.mark.skipif(not supported(i), reason=f"no {i}"))
              for i in ISAS]


@pytest.mark.parametrize("k", [64, 256, 576, 896, 1536])
def test_kernel_order_is_a_permutation_and_values_round_trip(k: int) -> None:
    order = kernel_order(k)
    assert torch.equal(order.sort().values, torch.arange(k))
    gen = torch.Generator().manual_seed(k)
    for kind, lo, hi in (("q4", 0, 16), ("q8", -128, 128)):
        q = torch.randint(lo, hi, (3, k), generator=gen)
        w = QuantWeight.pack(kind, q, torch.ones(3, k // 32), None)
        assert torch.equal(w.values().long(), q)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(40, 128), (67, 896), (33, 576), (16, 1536)])
def test_quant_matmul_matches_reference(isa: str, kind: str, affine: bool,
                                        shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    w = QuantWeight.random(kind, n, k, gen, affine)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 5, 8, 9, 16):
        x = torch.randn(rows, k, generator=gen) * 3
        ref = quant_matmul_ref(x, w) + bias
        got = quant_matmul(x, w, bias, isa=isa)
        # The same integer dot products; only the order of float additions differs.
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
        # And close to the unquantized product: activations are quantized to int8 per 32.
        full = x @ w.dequantize().t() + bias
        assert (got - full).abs().max() <= 0.02 * full.abs().max()


def test_quant_matmul_writes_column_slices_of_a_wider_output() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = QuantWeight.random("q4", 24, 256, gen), QuantWeight.random("q8", 40, 256, gen)
    x = torch.randn(3, 256, generator=gen)
    out = torch.full((3, 64), float("nan"))
    quant_matmul(x, a, out=out, col=0)
    quant_matmul(x, b, out=out, col=24)
    torch.testing.assert_close(out, torch.cat([quant_matmul_ref(x, a), quant_matmul_ref(x, b)], 1),
                               rtol=1e-5, atol=1e-4)


def test_activation_quantization_bounds() -> None:
    x = torch.randn(2, 64) * 10
    x[0, :32] = 0.0  # an all-zero group has scale 0
    xq, xd, xs = quantize_activations(x)
    assert xq.abs().max() <= 127 and xd[0, 0] == 0 and xs[0, 0] == 0
    back = (xq.float().view(2, 2, 32) * xd[..., None]).view(2, 64)
    assert (back - x).abs().max() <= xd.max() / 2 + 1e-6


def _random_blocks(qtype: object, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF blocks for an [n, k] tensor: random bits, with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)

    def put_f16(col: int, lo: float, hi: float) -> None:
        vals = rng.uniform(lo, hi, raw.shape[0]).astype(np.float16)
        raw[:, col:col + 2] = vals.view(np.uint8).reshape(-1, 2)

    if qtype == T.Q4_K:
        put_f16(0, 1e-3, 2e-2)
        put_f16(2, 1e-3, 2e-2)
    elif qtype == T.Q6_K:
        put_f16(size - 2, 1e-3, 2e-2)
    return raw.reshape(n, -1)


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, object, tuple[int, int]]]
                ) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype, shape) in tensors.items():
        if qtype == T.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The block types the presets hold (Q4_K, Q6_K: 1.5b; Q5_0, Q8_0: 0.5b; Q4_1: smollm2) and the
# other simple ones.
TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1", "Q4_0", "Q5_1"]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("quantization", ["auto", "int8", "int4"])
def test_gguf_blocks_decode_to_the_files_values(tmp_path: Path, qtype: str,
                                                quantization: str) -> None:
    rng = np.random.default_rng(0)
    n, k = 48, 512
    qt = T[qtype]
    if qt in (T.Q4_K, T.Q6_K):
        data = _random_blocks(qt, n, k, rng)
    else:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt)
    _write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (data, qt, (n, k))})
    (t,) = [GGUFTensor(x) for x in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors]
    ref = t.dequantize()  # the gguf package's dequantization: llama.cpp's values
    w = t.quantized(quantization)
    got = w.dequantize()
    scale = ref.abs().max()
    if quantization == "int4" and DIRECT.get(qtype) != "q4":
        assert w.kind == "q4"
        assert (got - ref).abs().max() <= 0.1 * scale  # requantized to 4 bits: lossy
    elif qtype in DIRECT:
        assert w.kind == ("q8" if quantization == "int8" else DIRECT[qtype])
        # the file's own values; only d and mn are rounded to fp16
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3 * scale)
    else:
        assert w.kind == "q8"  # requantized from the dequantized values
        assert (got - ref).abs().max() <= scale / 200
    # and the kernel on it agrees with the float product over the file's values
    x = torch.randn(4, k)
    y = quant_matmul(x, w)
    full = x @ ref.t()
    tol = 0.15 if quantization == "int4" and DIRECT.get(qtype) != "q4" else 0.03
    assert (y - full).abs().max() <= tol * full.abs().max()


def test_llama_qk_rows_are_unpermuted_in_every_part(tmp_path: Path) -> None:
    """Quantized rows, scales and offsets move together when llama.cpp's q/k order is undone."""
    rng = np.random.default_rng(1)
    heads, head_dim, hidden = 4, 16, 128
    w = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    data = gguf.quants.quantize(w, T.Q4_1)
    _write_gguf(tmp_path / "t.gguf", {"blk.0.attn_q.weight": (data, T.Q4_1, w.shape)})
    hf = {"num_attention_heads": heads, "architectures": ["LlamaForCausalLM"]}
    (name, qw), = list(load_tensors(tmp_path / "t.gguf", hf, "auto"))
    (_, fw), = list(load_tensors(tmp_path / "t.gguf", hf, "none"))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(qw.dequantize(), fw, rtol=2e-3, atol=2e-3)
