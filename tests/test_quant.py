"""Quantized CPU weights: the kernels against their references, GGUF block decoding against the
gguf package's own dequantization, and a tiny quantized model end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.cpu_kernels.build import available_paths
from specdec.models.gguf_weights import DIRECT, GGUFTensor, load_tensors
from specdec.models.quant_linear import (
    GROUP,
    QuantLinear,
    QuantWeight,
    embed_rows,
    quant_matmul,
    quant_matmul_ref,
    quantize_activations,
)

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
PATHS = available_paths()


@pytest.mark.parametrize("shape", [(3, 64), (16, 256), (40, 576), (17, 896)])
def test_pack_round_trips_values_scales_and_rows(shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    for kind, lo, hi in (("q4", 0, 16), ("q5", 0, 32), ("q8", -128, 128)):
        q = torch.randint(lo, hi, (n, k), generator=gen)
        d = torch.rand(n, k // 32, generator=gen).half().float()
        w = QuantWeight.pack(kind, q, d, -d)
        assert w.n % 16 == 0 and w.rows == n
        assert torch.equal(w.values()[:n].long(), q)
        assert torch.equal(w.scales()[0][:n].float(), d)
        ids = torch.tensor([n - 1, 0, n // 2])
        torch.testing.assert_close(embed_rows(w, ids), w.dequantize()[ids], rtol=0, atol=0)
        torch.testing.assert_close(w.select(ids).dequantize()[:3], w.dequantize()[ids])


def test_every_path_is_available_or_explained() -> None:
    assert "portable" in PATHS  # a C compiler is part of the install


@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(40, 128), (67, 896), (33, 576), (16, 1536)])
def test_quant_matmul_matches_reference_on_every_path(kind: str, affine: bool,
                                                      shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    w = QuantWeight.random(kind, n, k, gen, affine)
    bias = torch.randn(w.n, generator=gen)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17):
        x = torch.randn(rows, k, generator=gen) * 3
        ref = quant_matmul_ref(x, w) + bias
        outs = {p: quant_matmul(x, w, bias, path=p) for p in PATHS}
        # The same integer dot products; only the order of float additions differs from the
        # reference, and not at all between paths.
        for p, got in outs.items():
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item(),
                                       msg=p)
            assert torch.equal(got, outs["portable"]), p
        # A row's result does not depend on the rows beside it (exact speculation).
        for p in PATHS:
            assert torch.equal(quant_matmul(x[-1:], w, bias, path=p)[0], outs[p][-1]), p
        # And close to the unquantized product: activations are quantized to int8 per 32.
        full = x @ w.dequantize().t() + bias
        assert (outs["portable"] - full).abs().max() <= 0.02 * full.abs().max()


@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
def test_quant_matmul_extreme_values_on_every_path(kind: str) -> None:
    """The largest integer products each kind can hold, against activations at +-127: where a
    path sums products in 16 bits (avx2) nothing may saturate or wrap."""
    n, k = 32, 256
    top = {"q4": 15, "q5": 31}.get(kind)
    rows = []
    for sign in (1, -1):
        if top is not None:
            rows += [torch.full((k,), top), torch.zeros(k, dtype=torch.int64)]
        else:
            rows += [torch.full((k,), -128 if sign > 0 else 127),
                     torch.tensor([-128, 127] * (k // 2))]
    q = torch.stack(rows * (n // len(rows)))
    d = torch.full((n, k // GROUP), 0.01)
    w = QuantWeight.pack(kind, q, d, None)
    x = torch.stack([torch.full((k,), 3.0), torch.full((k,), -3.0),
                     torch.tensor([3.0, -3.0] * (k // 2)), torch.tensor([-3.0, 3.0] * (k // 2))])
    ref = quant_matmul_ref(x, w)
    for p in PATHS:
        got = quant_matmul(x, w, None, path=p)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(),
                                   msg=p)
        assert torch.equal(got, quant_matmul(x, w, None, path="portable")), p


def test_quant_linear_parts_with_padding_keep_their_columns() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = QuantWeight.random("q4", 40, 256, gen), QuantWeight.random("q8", 24, 256, gen)
    c = QuantWeight.random("q5", 8, 256, gen)
    bias = torch.randn(72, generator=gen)
    x = torch.randn(3, 256, generator=gen)
    want = torch.cat([quant_matmul_ref(x, a)[:, :40], quant_matmul_ref(x, b)[:, :24],
                      quant_matmul_ref(x, c)[:, :8]], 1) + bias
    got = QuantLinear([a, b, c], bias)(x)
    assert got.shape == (3, 72)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_weights_rehomed_for_huge_pages_compute_the_same() -> None:
    # Moved into one mapping advised for 2 MB pages (specdec/models/huge_pages.py): the same
    # values, each tensor 64-byte aligned, the first on a 2 MB boundary, and the layer's output
    # bit for bit what it was.
    import mmap

    from specdec.models.huge_pages import HUGE_PAGE, rehome

    gen = torch.Generator().manual_seed(1)
    a, b = QuantWeight.random("q4", 40, 256, gen), QuantWeight.random("q8", 24, 256, gen)
    layer = QuantLinear([a, b], None)
    x = torch.randn(5, 256, generator=gen)
    before, kept = layer(x), [(t.clone() if t is not None else None)
                              for w in (a, b) for t in (w.qs, w.d, w.mn)]
    arena = rehome([a, b])
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        assert arena is None
        return
    moved = [t for w in (a, b) for t in (w.qs, w.d, w.mn)]
    for old, new in zip(kept, moved):
        assert (old is None) == (new is None)
        if new is not None:
            assert torch.equal(old, new) and new.data_ptr() % 64 == 0
    assert a.qs.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(layer(x), before)


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
    for name, (data, qtype, _shape) in tensors.items():
        if qtype == T.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
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
    got = w.dequantize()[:n]
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
    y = quant_matmul(x, w)[:, :n]
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
    assert qw.rows == heads * head_dim


def test_freed_heap_memory_goes_back_to_the_os() -> None:
    # A GGUF's conversion frees large float buffers that glibc keeps in its heap; loading
    # returns them (specdec/models/heap.py). Heap memory freed under a live chunk stays
    # resident until then.
    import ctypes

    from specdec.models.heap import trim_heap

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("no malloc_trim in this C library")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def anon_kb() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("RssAnon:"))
        return int(line.split()[1])

    chunks = [libc.malloc(4000) for _ in range(40_000)]  # 160 MB, below the mmap threshold
    fence = libc.malloc(4000)
    for c in chunks:
        ctypes.memset(c, 1, 4000)
    for c in chunks:
        libc.free(c)
    held = anon_kb()
    trim_heap()
    assert held - anon_kb() > 100_000
    libc.free(fence)
