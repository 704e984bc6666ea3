"""EAGLE drafting: published checkpoint layouts, greedy equality and the output distribution
(chain and dynamic tree), and a training smoke test, on tiny random models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_distribution import ALPHA, PROMPT, V, exact_joint, sample
from test_engine import GREEDY, PROMPTS
from test_verifier import chisquare_p
from tiny_models import make_model

from drafters.eagle_head import EagleHead, head_config, load_head, save_head
from specdec import LLM, SamplingParams


def make_head(path: Path, target: Path, eagle3: bool, seed: int = 0, std: float = 0.3,
              draft_vocab: int | None = None) -> Path:
    """A random head written in the published layout for `target`."""
    torch.manual_seed(seed)
    hf = json.loads((target / "config.json").read_text())
    head = EagleHead(head_config(hf, eagle3, draft_vocab))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else std)
                    + (1.0 if "norm" in name else 0.0))
        if eagle3 and draft_vocab:
            keep = torch.randperm(hf["vocab_size"])[:draft_vocab].sort().values  # [draft_vocab]
            head.d2t.copy_(keep - torch.arange(draft_vocab))
            head.t2d.zero_()
            head.t2d[keep] = True
    save_head(head, path)
    return path


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return {"eagle1": make_head(tmp_path_factory.mktemp("e1"), tiny_llama, False),
            "eagle3": make_head(tmp_path_factory.mktemp("e3"), tiny_llama, True, seed=1,
                                draft_vocab=40)}


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    llm = LLM(model=str(tiny_llama), speculative={"method": "none"})
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_published_layouts_load(heads):
    from safetensors.torch import load_file

    e1 = load_file(str(heads["eagle1"] / "model.safetensors"))
    assert e1["fc.weight"].shape == (64, 128) and "fc.bias" in e1
    assert "layers.0.self_attn.q_proj.weight" in e1
    assert "layers.0.input_layernorm.weight" not in e1
    e3 = load_file(str(heads["eagle3"] / "model.safetensors"))
    assert e3["fc.weight"].shape == (64, 192)
    assert e3["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert e3["lm_head.weight"].shape == (40, 64)
    assert e3["d2t"].shape == (40,) and e3["t2d"].shape == (64,) and e3["t2d"].sum() == 40
    cfg = json.loads((heads["eagle3"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
    assert load_head(heads["eagle3"]).eagle3 and not load_head(heads["eagle1"]).eagle3


def test_wrong_shapes_are_refused(heads, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(heads["eagle1"] / "model.safetensors"))
    sd["fc.weight"] = sd["fc.weight"][:, :64].contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((heads["eagle1"] / "config.json").read_text())
    with pytest.raises(ValueError, match="fc.weight"):
        load_head(tmp_path)


def test_eagle3_maps_draft_vocab_to_target(heads):
    head = load_head(heads["eagle3"])
    logits = head.logits(torch.randn(3, 64), torch.nn.Identity())  # [3, 64]
    allowed = torch.isfinite(logits[0])
    assert torch.equal(allowed, head.t2d)


SPECS = {
    "eagle1-chain": ("eagle1", {"num_speculative_tokens": 4, "top_k": 1}),
    "eagle1-tree": ("eagle1", {"num_speculative_tokens": 4, "top_k": 3, "max_nodes": 8}),
    "eagle3-chain": ("eagle3", {"num_speculative_tokens": 3, "top_k": 1}),
    "eagle3-tree": ("eagle3", {"num_speculative_tokens": 3, "top_k": 4, "max_nodes": 10}),
}


@pytest.mark.parametrize("case", list(SPECS))
def test_greedy_equals_plain(tiny_llama, heads, reference, case):
    head, opts = SPECS[case]
    spec = {"method": "eagle", "eagle_head": str(heads[head]), **opts}
    llm = LLM(model=str(tiny_llama), speculative=spec)
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS[:3]]
    outs += llm.generate(PROMPTS[3:], GREEDY)  # and batched, with per-request settings
    assert [o.token_ids for o in outs] == reference
    assert all(o.spec is not None and o.spec.draft_tokens > 0 for o in outs)
    assert llm.engine.blocks.num_used == 0
    assert not llm.engine.drafting.drafters[("eagle", str(heads[head]))]._states


def test_a_long_sequence_is_read_from_its_last_context_positions(tiny_llama, heads, reference,
                                                                 monkeypatch):
    """Before its first draft a sequence's head state keeps only the last CONTEXT positions
    (chunk by chunk), so a long prompt's first proposal stays cheap; outputs are unchanged."""
    import drafters.eagle as eagle

    monkeypatch.setattr(eagle, "CONTEXT", 6)
    spec = {"method": "eagle", "eagle_head": str(heads["eagle3"]), "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_llama), speculative=spec)
    d = llm.engine.drafting.drafter(llm.engine.drafting.resolve(None))
    h = 3 * 64  # EAGLE-3 features: three captured residual streams of the hidden size
    d.observe("r", 0, list(range(20)), torch.randn(20, h))
    s = d._states["r"]
    assert (s.base, s.num_feats, s.features().shape[0]) == (14, 6, 6)
    d.observe("r", 20, list(range(24)), torch.randn(4, h))  # a further chunk, whole
    assert (s.base, s.num_feats) == (18, 6)
    d.observe("r", 24, list(range(26)), torch.randn(2, h))
    assert (s.base, s.num_feats, s.features().shape[0]) == (20, 6, 6)
    d.release("r")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.spec.draft_tokens > 0 for o in outs)


def test_tree_respects_per_request_settings(tiny_llama, heads):
    llm = LLM(model=str(tiny_llama), speculative={"method": "eagle",
                                                  "eagle_head": str(heads["eagle1"])})
    spec = {"method": "eagle", "num_speculative_tokens": 3, "top_k": 2, "max_nodes": 5}
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True, speculative=spec))[0]
    assert out.spec.draft_tokens <= 5 * out.spec.steps


def test_a_requests_own_head_is_used(tiny_llama, heads, reference):
    llm = LLM(model=str(tiny_llama), speculative={"method": "eagle",
                                                  "eagle_head": str(heads["eagle1"])})
    own = {"method": "eagle", "eagle_head": str(heads["eagle3"]), "num_speculative_tokens": 3}
    out = llm.generate([PROMPTS[0]], dataclasses.replace(GREEDY, speculative=own))[0]
    assert out.token_ids == reference[0] and out.spec.draft_tokens > 0
    built = {key[1] for key in llm.engine.drafting.drafters if key[0] == "eagle"}
    assert str(heads["eagle3"]) in built  # not silently the engine's eagle1 head
    missing = {"method": "eagle", "eagle_head": str(heads["eagle1"]) + "-nope"}
    with pytest.raises(ValueError, match="speculative.eagle_head"):  # at admission
        llm.generate([PROMPTS[0]], dataclasses.replace(GREEDY, speculative=missing))
    assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def dist_setup(tmp_path_factory):
    target = make_model(tmp_path_factory.mktemp("eagle_dist"), "llama", vocab_size=V,
                        hidden=32, layers=2, seed=5, std=0.15)
    head = make_head(tmp_path_factory.mktemp("eagle_dist_head"), target, False, seed=3,
                     std=0.15)
    torch.set_num_threads(1)
    llm = LLM(model=str(target), speculative={"method": "eagle", "eagle_head": str(head)},
              max_num_seqs=1024, max_num_batched_tokens=16384)
    return target, llm


@pytest.mark.parametrize("opts", [{"num_speculative_tokens": 3, "top_k": 1},
                                  {"num_speculative_tokens": 2, "top_k": 2, "max_nodes": 4}],
                         ids=["chain", "tree"])
def test_continuations_follow_the_target(dist_setup, opts, monkeypatch):
    import test_distribution

    # Fewer requests than test_distribution's: the head is a Python loop per request.
    monkeypatch.setattr(test_distribution, "REQUESTS", 1200)
    target, llm = dist_setup
    spec = {"method": "eagle", **opts}
    counts, drafted, accepted = sample(llm, spec, seed=4242 + len(opts), max_tokens=6)
    assert drafted > 600 and accepted > 60
    exact = exact_joint(target, PROMPT, SamplingParams())
    assert chisquare_p(counts, exact) > ALPHA


def test_train_drafter_smoke_and_resume(tiny_llama, tmp_path, reference, capsys):
    from specdec.train_drafter import main

    rng = torch.Generator().manual_seed(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(12):
            ids = torch.randint(2, 64, (24,), generator=rng).tolist()
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")
    out = tmp_path / "head"
    argv = ["--target", str(tiny_llama), "--data", str(tmp_path / "data.jsonl"), "--out",
            str(out), "--num-samples", "12", "--batch-size", "4", "--eval-prompts", "0",
            "--self-distill", "6"]
    assert main(argv + ["--epochs", "1"]) == 0
    assert main(argv + ["--epochs", "2"]) == 0
    assert "resuming after epoch 1" in capsys.readouterr().out
    argv3 = [a if a != str(out) else str(tmp_path / "head3") for a in argv]
    assert main(argv3 + ["--epochs", "1", "--eagle3", "--draft-vocab", "32"]) == 0
    assert load_head(tmp_path / "head3").lm_head.weight.shape == (32, 64)
    capsys.readouterr()
    argv4 = [a if a != str(out) else str(tmp_path / "head4") for a in argv]
    eagle3 = ["--epochs", "1", "--eagle3", "--draft-vocab", "32"]
    assert main(argv4 + eagle3 + ["--also", str(tmp_path / "head3")]) == 0
    assert "24 sequences" in capsys.readouterr().out  # its own 12 and head3's
    with pytest.raises(SystemExit, match="of another"):  # EAGLE-1 features: 64 wide
        main(argv4 + eagle3 + ["--also", str(out)])
    for head in (out, tmp_path / "head3"):
        spec = {"method": "eagle", "eagle_head": str(head), "num_speculative_tokens": 3}
        outs = LLM(model=str(tiny_llama), speculative=spec).generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference


def test_shipped_smollm2_head_layout():
    from drafters.eagle import default_head_for

    path = default_head_for("smollm2-135m")
    assert path is not None and (path / "model.safetensors").stat().st_size < 30e6
    head = load_head(path, 576)
    assert not head.eagle3 and head.fc.weight.shape == (576, 1152)


def test_shipped_qwen_coder_head_layout():
    """The qwen2.5-coder-1.5b head: EAGLE-3, a 4096-token draft vocabulary, int8 within the
    repository's 64 MB, and on the CPU's int8 kernels when asked."""
    from drafters.eagle import default_head_for
    from specdec.models.quant_linear import QuantLinear

    path = default_head_for("qwen2.5-coder-1.5b")
    assert path is not None and (path / "model.safetensors").stat().st_size <= 64e6
    head = load_head(path, 1536, int8_kernels=True)
    assert head.eagle3 and head.d2t.numel() == 4096 and head.capture_layers(28) == (1, 13, 24)
    assert isinstance(head.lm_head, QuantLinear) and head.lm_head.out_features == 4096
