"""Fused decoder kernels against their PyTorch references (interpreter on the CPU, float32)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.cli_options import runtime_from_env
from specdec.models.loader import fused_kernels
from verify_kernels.fused_ops import (
    embed_scaled,
    embed_scaled_ref,
    rms_norm,
    rms_norm_ref,
    rope_ref,
    rope_table,
    rope_table_ref,
    rope_write_kv,
    silu_mul,
    silu_mul_ref,
)
from verify_kernels.reference import write_kv_ref
from verify_kernels.skinny_gemm import (
    fused_linear,
    residual_linear,
    skinny_linear,
    skinny_linear_ref,
)
from verify_kernels.skinny_tiles import TileChoices

DEV = "cuda" if os.environ.get("SPECDEC_TEST_DEVICE") == "cuda" else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
TOL = {"atol": 2e-2, "rtol": 2e-2} if DT == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
MM_TOL = {"atol": 5e-2, "rtol": 3e-2} if DT == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
# SPECDEC_SKINNY_TUNE=0 (bench/gpu_run.sh, which runs this file without the conftest): each
# matmul shape takes its first tile candidate untimed.
SKINNY_TUNE = runtime_from_env().skinny_tune


@pytest.fixture
def tiles() -> TileChoices:
    """A test's own tile choices, as a model holds them."""
    return TileChoices(tune=SKINNY_TUNE)


@pytest.mark.parametrize("t,h", [(1, 64), (5, 96), (3, 128)])
def test_rms_norm(t, h):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g).to(DEV, DT)
    w = torch.randn(h, generator=g).to(DEV, DT)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("t,h", [(1, 64), (7, 96), (16, 128)])
def test_embed_scaled(t, h, tiles):
    """Embedding rows, and the first norm's input as a matmul consuming `prenormed` reads it:
    the qkv matmul on it equals the one with the norm folded in."""
    from verify_kernels.skinny_gemm import ScaledRows

    g = torch.Generator().manual_seed(t + h)
    table = torch.randn(50, h, generator=g).to(DEV, DT)
    norm = (torch.rand(h, generator=g) + 0.5).to(DEV, DT)
    ids = torch.randint(0, 50, (t,), generator=g).to(DEV)
    out, scaled, ss = embed_scaled(ids, table, norm)
    ref = embed_scaled_ref(ids, table, norm)
    assert torch.equal(out, ref[0])
    torch.testing.assert_close(scaled, ref[1], **TOL)
    torch.testing.assert_close(ss, ref[2], **TOL)
    w = (torch.randn(24, h, generator=g) / h ** 0.5).to(DEV, DT)
    got = fused_linear(out, w, norm_weight=norm, eps=1e-5, prenormed=ScaledRows(scaled, ss),
                       tiles=tiles)
    torch.testing.assert_close(got.float(), skinny_linear_ref(out, w, norm_weight=norm,
                                                              eps=1e-5).float(), **MM_TOL)


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 64), (5, 6, 2, 128), (3, 2, 2, 64)])
def test_rope_write_kv(t, hq, hkv, d):
    """q rotated in place inside a fused qkv row; rotated k and plain v land at their slots;
    a negative slot writes nothing."""
    g = torch.Generator().manual_seed(t * d + hq)
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 5, generator=g).to(DEV, DT)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 4000, (t,), generator=g).to(DEV)
    inv = (1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    nb, bs = 6, 4
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
    slots[0] = -1
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DT)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DT)
    q_ref = rope_ref(q.clone(), pos, inv, 1.1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    write_kv_ref(rope_ref(k, pos, inv, 1.1)[keep], v[keep], kc_ref, vc_ref, slots[keep])
    tail = qkv[:, (hq + 2 * hkv) * d:].clone()
    rope_write_kv(q, k, v, pos, inv, 1.1, kc, vc, slots)
    tol = {"atol": 1e-4, "rtol": 1e-4} if DT == torch.float32 else TOL
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)
    torch.testing.assert_close(vc, vc_ref, **tol)
    assert torch.equal(qkv[:, (hq + 2 * hkv) * d:], tail)


@pytest.mark.parametrize("t,d", [(1, 64), (9, 128)])
def test_rope_table(t, d):
    """Each row's cos and sign-folded sin factors, scaled; rotating with them is rope_ref."""
    g = torch.Generator().manual_seed(t + d)
    pos = torch.randint(0, 130000, (t,), generator=g).to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    table = rope_table(pos, inv, 1.1)
    assert table.shape == (t, 2, d) and table.dtype == torch.float32
    torch.testing.assert_close(table, rope_table_ref(pos, inv, 1.1), atol=1e-5, rtol=1e-5)
    x = torch.randn(t, 3, d, generator=g).to(DEV)
    turned = torch.cat([x[..., d // 2:], x[..., :d // 2]], dim=-1)
    rotated = x * table[:, None, 0] + turned * table[:, None, 1]
    torch.testing.assert_close(rotated, rope_ref(x, pos, inv, 1.1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t,inter", [(1, 64), (3, 1500)])
def test_silu_mul(t, inter):
    gu = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEV, DT)
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), **TOL)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 128), (200, 96)])
@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "float32"])
def test_skinny_linear(m, n, k, prologue, epilogue, tiles):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k if prologue == "silu" else k, generator=g).to(DEV, DT)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, DT)
    kw = {}
    if prologue == "norm":
        kw.update(norm_weight=torch.randn(k, generator=g).to(DEV, DT), eps=1e-5)
    kw["silu_mul"] = prologue == "silu"
    bias = torch.randn(n, generator=g).to(DEV, DT) if epilogue == "bias" else None
    if epilogue == "residual":
        kw["residual"] = torch.randn(m, n, generator=g).to(DEV, DT)
    if epilogue == "float32":
        kw["out_dtype"] = torch.float32
    ref = skinny_linear_ref(x, w, bias, **{**kw, "residual": kw.get("residual")})
    res_before = kw["residual"].clone() if "residual" in kw else None
    out = skinny_linear(x, w, bias, tiles=tiles, **kw)
    assert out.dtype == ref.dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), **MM_TOL)
    if res_before is not None:  # the residual is the output buffer, updated in place
        assert out.data_ptr() == kw["residual"].data_ptr()
        assert not torch.equal(kw["residual"], res_before)


@pytest.mark.parametrize("m", [1, 5, 16, 20])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fma", [False, True])
def test_gated_linear(m, norm, bias, fma, tiles):
    """silu(gate) * up as the epilogue of a [2N, K] gate_up weight (cuBLAS and silu_mul past
    16 rows); the several-row FMA path when `fma`."""
    from verify_kernels import skinny_tiles

    if fma and not 1 < m <= skinny_tiles.FMA_MAX_ROWS:
        pytest.skip("the FMA candidate serves 2..8 rows")
    g = torch.Generator().manual_seed(7 * m + norm + 2 * bias)
    n, k = 72, 96
    x = torch.randn(m, k, generator=g).to(DEV, DT)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEV, DT)
    kw = {"gated": True}
    if norm:
        kw.update(norm_weight=(torch.rand(k, generator=g) + 0.5).to(DEV, DT), eps=1e-5)
    b = torch.randn(2 * n, generator=g).to(DEV, DT) if bias else None
    ref = skinny_linear_ref(x, w, b, **kw)
    if fma:
        with tiles.recording_keys() as keys:
            skinny_linear(x, w, b, tiles=tiles, **kw)
        tiles.set_config(keys[0], (16, 32, 4, 1, "fma"))
    out = fused_linear(x, w, b, tiles=tiles, **kw)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), **MM_TOL)


def test_fused_linear_past_skinny_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 2 * 48, generator=g).to(DEV, DT)
    w = (torch.randn(64, 48, generator=g) / 7).to(DEV, DT)
    res = torch.randn(20, 64, generator=g).to(DEV, DT)
    ref = skinny_linear_ref(x, w, silu_mul=True, residual=res)
    out = fused_linear(x, w, silu_mul=True, residual=res)
    assert out.data_ptr() == res.data_ptr()
    torch.testing.assert_close(out.float(), ref.float(), **MM_TOL)


@pytest.mark.skipif(DEV == "cuda", reason="the CPU model check runs under the interpreter")
@pytest.mark.parametrize("rows,backend", [(1, "torch"), (12, "torch"), (20, "torch"),
                                          (12, "triton")])
def test_fused_model_equals_eager(tiny_llama, rows, backend, monkeypatch):
    """The fused forward (skinny matmuls up to 16 rows, cuBLAS-style past that) gives the eager
    logits, and writes the same KV: a decode step after it agrees too. With the Triton backend
    that decode step is the fused decode kernel (rotary, KV write and attention in one)."""
    from specdec.engine import LLMEngine
    from specdec.step_inputs import Segment

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        eng = LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"}, num_blocks=8,
                                  attention_backend=backend if fused else "torch")
        eng.runner.model.kernels = fused_kernels(skinny_tune=SKINNY_TUNE) if fused else None
        seg = Segment(list(range(1, rows + 1)), list(range(rows)), list(range(rows)), 0, [0, 1],
                      logits_rows=tuple(range(rows)))
        first = eng.runner.execute([seg]).logits
        step = Segment([5], [rows], [rows], rows, [0, 1], logits_rows=(0,))
        return first, eng.runner.execute([step]).logits

    from verify_kernels import backend as triton_backend

    calls = []
    kernel = triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    eager, fused = run(False), run(True)
    assert len(calls) == (2 if backend == "triton" else 0)  # the decode step, both layers
    torch.testing.assert_close(fused[0], eager[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused[1], eager[1], atol=1e-4, rtol=1e-4)


def test_skinny_tile_choice_hooks(tiles):
    """What the graph runner's in-graph tuning relies on: keys of the calls made inside
    `recording_keys`, in order and once each, with the configs that ran for them; choices are
    the caller's, another TileChoices holds its own."""
    w1, w2 = torch.randn(48, 64).to(DEV, DT), torch.randn(40, 48).to(DEV, DT)
    x = torch.randn(3, 64).to(DEV, DT)
    with tiles.recording_keys() as keys:
        y = skinny_linear(x, w1, tiles=tiles)
        skinny_linear(y, w2, tiles=tiles)
        skinny_linear(x, w1, tiles=tiles)
    assert len(keys) == 2 and keys[0][:3] == (4, 48, 64) and keys[1][:3] == (4, 40, 48)
    cands = tiles.candidates(keys[0])
    assert cands and tiles.config_of(keys[0]) == cands[0]
    tiles.set_config(keys[0], cands[-1])
    assert tiles.config_of(keys[0]) == cands[-1]
    other = TileChoices(tune=SKINNY_TUNE)
    assert other.config_of(keys[0]) is None and set(tiles.chosen_configs()) == set(keys)
    tol = {"atol": 3e-2, "rtol": 3e-2} if DT == torch.bfloat16 else {}
    torch.testing.assert_close(skinny_linear(x, w1, tiles=tiles), skinny_linear_ref(x, w1),
                               **tol)
    tiles.forget()
    assert tiles.chosen_configs() == {} and tiles.candidates(keys[0]) == []


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("prologue", ["norm", "silu"])
def test_skinny_candidates_fold_the_prologue(m, prologue, tiles):
    """The FMA candidates (16 columns, and 2 as at one row) and the swapped dot candidate, each
    with the prologue in its loop (norm or SiLU-and-multiply folded in, residual in place),
    against the reference, forced through set_config as the tuner would pick them."""
    g = torch.Generator().manual_seed(m)
    n, k = 40, 96
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, DT)
    x = torch.randn(m, 2 * k if prologue == "silu" else k, generator=g).to(DEV, DT)
    res = torch.randn(m, n, generator=g).to(DEV, DT)
    kw = ({"norm_weight": (torch.rand(k, generator=g) + 0.5).to(DEV, DT)}
          if prologue == "norm" else {"silu_mul": True})
    ref = skinny_linear_ref(x, w, residual=res, **kw)
    with tiles.recording_keys() as keys:
        skinny_linear(x, w, residual=res.clone(), tiles=tiles, **kw)  # records and tunes it
    tol = {"atol": 3e-2, "rtol": 3e-2} if DT == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    for cfg in ((16, 32, 4, 1, "fma"), (2, 64, 4, 1, "fma"), (64, 32, 4, 1, "swap")):
        tiles.set_config(keys[0], cfg)
        out = skinny_linear(x, w, residual=res.clone(), tiles=tiles, **kw)
        torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("forced", [False, True])
def test_residual_linear_leaves_the_next_norm_input(m, gated, forced, tiles):
    """An o_proj-style matmul (residual added in place) leaves the next RMSNorm's input; the
    matmul that reads it as `prenormed` gives what normalising the residual itself gives. When
    `forced`, the producer runs the FMA candidate with 4-column programs and leaves more
    partial sums (275) than a 16-row consumer reads in one tile (256)."""
    if forced and m != 5:
        pytest.skip("one row count covers the forced tiles (the FMA candidate serves 2..8)")
    g = torch.Generator().manual_seed(11 * m + 2 * gated + forced)
    k, hidden, n = 96, 1100 if forced else 300, 72
    x = torch.randn(m, k, generator=g).to(DEV, DT)
    w_o = (torch.randn(hidden, k, generator=g) / k ** 0.5).to(DEV, DT)
    res = torch.randn(m, hidden, generator=g).to(DEV, DT)
    norm = (torch.rand(hidden, generator=g) + 0.5).to(DEV, DT)
    w = (torch.randn(2 * n if gated else n, hidden, generator=g) / hidden ** 0.5).to(DEV, DT)
    res_ref = skinny_linear_ref(x, w_o, residual=res)
    ref = skinny_linear_ref(res_ref, w, norm_weight=norm, eps=1e-5, gated=gated)

    def chain():
        r = res.clone()
        scaled = residual_linear(x, w_o, None, r, norm, tiles=tiles)
        return r, scaled, fused_linear(r, w, norm_weight=norm, eps=1e-5, gated=gated,
                                       prenormed=scaled, tiles=tiles)

    with tiles.recording_keys() as keys:
        r, scaled, out = chain()
    assert scaled.scaled.shape == (m, hidden) and scaled.sumsq.shape[1] == m
    if forced:
        tiles.set_config(keys[0], (4, 32, 4, 1, "fma"))
        tiles.set_config(keys[1], (64, 32, 4, 1, "swap"))
        r, scaled, out = chain()
        assert scaled.sumsq.shape[0] == 275
    torch.testing.assert_close(r.float(), res_ref.float(), **MM_TOL)
    torch.testing.assert_close(out.float(), ref.float(), **MM_TOL)


@pytest.mark.skipif(DEV == "cuda", reason="the CPU model check runs under the interpreter")
def test_fused_triton_path_speculation_equals_plain(tiny_llama, tiny_draft, monkeypatch):
    """The GPU's model path (fused matmuls; rotary, KV write and attention in one kernel for
    decode steps and for verification steps of uniform rows, the general kernel for ragged
    ones) under the interpreter: greedy chains and trees give the outputs of plain greedy
    decoding on the reference path."""
    from specdec import LLM, SamplingParams
    from verify_kernels import backend as triton_backend

    fused_calls, tree_calls = [], []
    kernel, tree_kernel = triton_backend.decode_attention, triton_backend.tree.tree_attention
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **kw: fused_calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(triton_backend.tree, "tree_attention",
                        lambda *a, **kw: tree_calls.append(1) or tree_kernel(*a, **kw))
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [9, 10, 11, 9, 10, 11, 9, 10, 12], [7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), speculative={"method": "none"})
    ref = [plain.generate([p], greedy)[0].token_ids for p in prompts]
    specs = [{"method": "ngram", "num_speculative_tokens": 4, "branches": 2},
             {"method": "draft_model", "draft_model": str(tiny_draft),
              "num_speculative_tokens": 3}, None]
    llm = LLM(model=str(tiny_llama), speculative={"method": "none"},
              attention_backend="triton")
    llm.engine.runner.model.kernels = fused_kernels(skinny_tune=SKINNY_TUNE)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative=s)
              for s in specs]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert outs[0].spec.steps > 0 and outs[1].spec.steps > 0
    assert fused_calls  # the plain request's decode steps
    # Alone, a draft-model request verifies the same 4 rows every step: the fused tree kernel.
    assert llm.generate([prompts[1]], params[1])[0].token_ids == ref[1]
    assert tree_calls
