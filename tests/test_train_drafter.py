"""EAGLE-head training pipeline on tiny random models: training lowers the loss, feature shards
resume and respect their disk bound, sampled self-distillation is seeded, the EAGLE-3 draft
vocabulary round-trips through a saved head, and int8 heads stay close to float ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from drafters.eagle_head import (
    EagleHead,
    draft_to_target,
    head_config,
    linear_weights,
    load_head,
    quantize_head,
    save_head,
    set_draft_vocab,
    target_to_draft,
)
from specdec import drafter_data
from specdec.drafter_data import (
    SHARD_OVERHEAD,
    bytes_per_token,
    capture_features,
    collect_shards,
    load_shards,
    self_distill,
)


def write_texts(path: Path, n: int, length: int = 24, seed: int = 0) -> Path:
    rng = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(2, 64, (length,), generator=rng).tolist()
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")
    return path


def random_seqs(n: int, seed: int = 0, lo: int = 5, hi: int = 20) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (int(torch.randint(lo, hi, (1,), generator=rng)),),
                          generator=rng).tolist() for _ in range(n)]


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """Sequences per capture_features call made by collect_shards (one call per shard)."""
    calls: list[int] = []

    def wrapper(model, seqs, *a, **kw):
        calls.append(len(seqs))
        return capture_features(model, seqs, *a, **kw)

    monkeypatch.setattr(drafter_data, "capture_features", wrapper)
    return calls


def test_training_lowers_the_loss_and_writes_a_loadable_head(tiny_llama, tmp_path, capsys):
    from specdec import LLM, SamplingParams
    from specdec.train_drafter import main

    data = write_texts(tmp_path / "data.jsonl", 16)
    out = tmp_path / "head"
    # 16 prompts + 1 sample each = 32 sequences of 28-40 tokens; the bound cuts some.
    gb = (24 * 34 * bytes_per_token(3 * 64) + 3 * SHARD_OVERHEAD) / 1e9
    assert main(["--target", str(tiny_llama), "--data", str(data), "--out", str(out),
                 "--num-samples", "16", "--batch-size", "4", "--eval-prompts", "0",
                 "--epochs", "5", "--lr", "3e-3", "--eagle3", "--draft-vocab", "32",
                 "--self-distill", "4", "--distill-samples", "1", "--shard-size", "8",
                 "--max-feature-gb", f"{gb:.12f}", "--quantize", "int8"]) == 0
    printed = capsys.readouterr().out
    kept = int(re.search(r"collecting (\d+) of 32 sequences", printed).group(1))
    seqs = json.loads((out / "features" / "sequences.json").read_text())["seqs"]
    assert len(seqs) == 32 and 16 <= kept < 32
    tokens = sum(len(s) for s in seqs[:kept])  # training used exactly the collected ones
    assert re.search(rf"^{kept} sequences, {tokens} tokens", printed, re.M)
    losses = torch.load(out / "train_state.pt", weights_only=False)["losses"]
    assert len(losses) == 5 and losses[-1] < 0.85 * losses[0], losses
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specdec_quantization"]["method"] == "int8"
    head = load_head(out)
    assert head.eagle3 and head.lm_head.weight.shape == (32, 64)
    spec = {"method": "eagle", "eagle_head": str(out), "num_speculative_tokens": 3}
    res = LLM(model=str(tiny_llama), speculative=spec).generate(
        [[3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert res.spec is not None and res.spec.draft_tokens > 0


def test_distill_samples_need_a_length(tiny_llama, tmp_path):
    from specdec.train_drafter import main

    with pytest.raises(SystemExit):
        main(["--target", str(tiny_llama), "--out", str(tmp_path), "--distill-samples", "2"])


def test_shards_resume_recomputing_only_missing_or_stale_ones(tiny_llama, tmp_path, counted):
    seqs = random_seqs(10)
    d = tmp_path / "features"
    paths = collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", shard_size=3)
    assert [p.name for p in paths] == [f"shard_{k:05d}.pt" for k in range(4)]
    assert counted == [3, 3, 3, 1]
    first = load_shards(paths)
    assert [r["tokens"].tolist() for r in first] == seqs
    mtimes = [p.stat().st_mtime_ns for p in paths]

    paths[1].unlink()
    paths[2].write_bytes(b"half a shard")  # damaged
    (d / "shard_00003.tmp").write_bytes(b"left by a killed run")
    counted.clear()
    again = collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", shard_size=3)
    assert again == paths and counted == [3, 3]
    assert [p.stat().st_mtime_ns for p in paths[::3]] == mtimes[::3]  # 0 and 3 not rewritten
    assert not list(d.glob("*.tmp"))
    for a, b in zip(first, load_shards(again)):
        assert torch.equal(a["feats"], b["feats"]) and torch.equal(a["next"], b["next"])

    counted.clear()
    seqs[4] = seqs[4][:-1]  # shard 1's data changed: its features are stale
    collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", shard_size=3)
    assert counted == [3]
    counted.clear()
    collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", shard_size=3)
    assert counted == []


def test_batched_capture_equals_one_sequence_at_a_time(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    seqs = random_seqs(5, seed=3)
    batched = capture_features(model, seqs, (0, 1), 5, "cpu")  # padded to the longest
    for s, row in zip(seqs, batched):
        alone = capture_features(model, [s], (0, 1), 1, "cpu")[0]
        assert row["feats"].shape == (len(s), 128)
        torch.testing.assert_close(row["feats"].float(), alone["feats"].float(),
                                   atol=4e-3, rtol=4e-3)  # fp16 storage: a unit in the last place
        assert torch.equal(row["next"], alone["next"])
        # No autograd graph kept alive: a 1024-sequence capture held every batch's activations
        # and was killed for memory (24 GB) at 48 sequences when this was lost.
        assert not row["feats"].requires_grad and row["feats"].grad_fn is None


def test_shards_respect_the_disk_bound(tiny_llama, tmp_path, counted, capsys):
    seqs = random_seqs(10, lo=10, hi=11)  # 10 tokens each
    per_seq = 10 * bytes_per_token(64)
    bound = 2 * SHARD_OVERHEAD + 5 * per_seq + per_seq // 2  # fits 5 sequences in 2 shards
    d = tmp_path / "features"
    paths = collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", 3, bound)
    assert "collecting 5 of 10 sequences" in capsys.readouterr().out
    assert counted == [3, 2] and len(load_shards(paths)) == 5
    assert sum(p.stat().st_size for p in d.glob("shard_*")) <= bound

    counted.clear()  # a larger bound: the short last shard is redone, then new ones follow
    paths = collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", 3)
    assert counted == [3, 3, 1] and len(load_shards(paths)) == 10
    counted.clear()  # a smaller one: shards past it are removed
    paths = collect_shards(str(tiny_llama), seqs, (), 64, d, 4, "cpu", 3,
                           SHARD_OVERHEAD + 3 * per_seq)
    assert counted == [] and sorted(d.glob("shard_*")) == paths and len(paths) == 1


def test_sampled_self_distillation_is_seeded_and_distinct(tiny_llama):
    prompts = [[3, 5, 7, 9], [10, 11, 12], [20, 2, 40, 41, 42]]
    greedy = self_distill(str(tiny_llama), prompts, 8)
    a = self_distill(str(tiny_llama), prompts, 8, samples=3, temperature=0.7, seed=0)
    assert a == self_distill(str(tiny_llama), prompts, 8, samples=3, temperature=0.7, seed=0)
    b = self_distill(str(tiny_llama), prompts, 8, samples=3, temperature=0.7, seed=1)
    assert len(a) == len(b) == 4 * len(prompts)
    assert a[::4] == b[::4] == greedy  # each prompt's greedy sequence comes first
    for k, p in enumerate(prompts):
        group = a[4 * k:4 * k + 4]
        assert all(s[:len(p)] == p and len(s) > len(p) for s in group)
        assert len({tuple(s) for s in group}) == 4
    assert a != b  # another seed draws other samples


def tiny_eagle3(tmp_path: Path, draft_vocab: int = 40, seed: int = 0) -> tuple[EagleHead, Path]:
    from tiny_models import make_model

    target = make_model(tmp_path / "target", "llama", vocab_size=64)
    torch.manual_seed(seed)
    hf = json.loads((target / "config.json").read_text())
    head = EagleHead(head_config(hf, True, draft_vocab))  # default init: trained-head scale
    return head, target


def test_draft_vocab_round_trips_through_a_saved_head(tmp_path):
    head, _ = tiny_eagle3(tmp_path)
    keep = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40]  # unsorted
    set_draft_vocab(head, keep)
    for quantize in (None, "int8"):
        save_head(head, tmp_path / str(quantize), quantize=quantize)
        loaded = load_head(tmp_path / str(quantize))
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        draft = torch.arange(40)
        targets = draft_to_target(loaded, draft)
        assert torch.equal(targets, keep.sort().values)
        assert torch.equal(target_to_draft(loaded, targets), draft)
        assert torch.equal(draft_to_target(loaded, target_to_draft(loaded, keep)), keep)
        outside = torch.tensor(sorted(set(range(64)) - set(keep.tolist())))
        assert (target_to_draft(loaded, outside) == -1).all()
        # Draft logit i lands on target id draft_to_target(i); only kept ids are finite.
        h = torch.randn(2, 64)
        logits = loaded.logits(h, torch.nn.Identity())  # [2, 64]
        draft_logits = loaded.lm_head(loaded.norm(h))  # [2, 40]
        assert torch.equal(logits[:, targets], draft_logits)
        assert torch.equal(torch.isfinite(logits[0]), loaded.t2d)
        assert torch.equal(loaded.greedy(h, torch.nn.Identity()), logits.argmax(-1))
        tied = torch.zeros(1, 64)  # every draft logit equal: the first maximum either way
        assert torch.equal(loaded.greedy(tied, torch.nn.Identity()),
                           loaded.logits(tied, torch.nn.Identity()).argmax(-1))

    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "None" / "model.safetensors"))
    sd["d2t"][1] = sd["d2t"][0] - 1  # draft ids 0 and 1 now name the same target id
    save_file(sd, str(tmp_path / "None" / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary"):
        load_head(tmp_path / "None")


@pytest.mark.parametrize("group", [0, 32], ids=["per-row", "group32"])
def test_int8_head_is_close_to_the_float_head_and_small(tmp_path, group):
    from safetensors.torch import load_file

    head, _ = tiny_eagle3(tmp_path, seed=2)
    set_draft_vocab(head, torch.randperm(64)[:40])
    save_head(head, tmp_path / "f16", torch.float16)
    save_head(head, tmp_path / "float")
    quantize_head(tmp_path / "float", tmp_path / "int8", group)  # from an existing head dir
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    names = linear_weights(head)
    assert all(stored[n].dtype == torch.int8 for n in names)

    # Every weight within half a quantization step of its row's (group's) largest weight / 127
    # (plus the float16 rounding of the scale).
    q = load_head(tmp_path / "int8")
    ref_sd, q_sd = head.state_dict(), q.state_dict()
    for n in names:
        w = ref_sd[n].reshape(ref_sd[n].shape[0], -1, group or ref_sd[n].shape[1])
        step = w.abs().amax(-1, keepdim=True) / 127  # [N, G, 1]
        err = (q_sd[n].reshape(w.shape) - w).abs()
        assert (err <= 0.51 * step).all(), n

    # Logits: each of the ~5 chained int8 matmuls adds ~0.4% relative error (uniform rounding
    # of at most 1/254 of the row maximum, averaged over the inputs), so 2% RMS leaves margin;
    # a wrong scale layout or a missing dequantization is off by far more.
    torch.manual_seed(3)
    feats, emb = torch.randn(2, 10, 192), torch.randn(2, 10, 64)
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    with torch.no_grad():
        outs = []
        for h in (head, q):
            x, _, _ = h.step(h.fuse(feats), emb, torch.arange(10), None, mask)
            outs.append(h.logits(x.reshape(-1, 64), torch.nn.Identity()))  # [20, 64]
    ref, got = outs
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    rel = (got[fin] - ref[fin]).pow(2).mean().sqrt() / ref[fin].pow(2).mean().sqrt()
    assert 0 < rel < 0.02, float(rel)

    # Size: one byte per Linear weight, float16 scales, float16 norms, the int vocab maps,
    # and the safetensors header.
    sd = head.state_dict()
    n_lin = sum(sd[n].numel() for n in names)
    scales = sum(sd[n].shape[0] * (sd[n].shape[1] // (group or sd[n].shape[1])) for n in names)
    other = sum(v.numel() * 2 for k, v in sd.items() if k not in names and v.is_floating_point())
    maps = sd["d2t"].numel() * 8 + sd["t2d"].numel()
    size = (tmp_path / "int8" / "model.safetensors").stat().st_size
    assert n_lin + 2 * scales + other + maps <= size <= n_lin + 2 * scales + other + maps + 4096
    assert size < 0.6 * (tmp_path / "f16" / "model.safetensors").stat().st_size


def test_int8_head_runs_its_stored_weights_on_the_cpu_kernels(tmp_path):
    """Next to a quantized target a head keeps its int8 weights: each Linear becomes a
    QuantLinear holding exactly the stored values (no second rounding), and its logits differ
    from the dequantized head's only by the kernels' int8 activations. Scales the kernels cannot
    hold (groups of 16 columns) and float heads stay float."""
    from specdec.models.quant_linear import QuantLinear

    head, _ = tiny_eagle3(tmp_path, seed=4)
    set_draft_vocab(head, torch.randperm(64, generator=torch.Generator().manual_seed(5))[:40])
    save_head(head, tmp_path / "int8", quantize="int8")
    ref = load_head(tmp_path / "int8")
    q = load_head(tmp_path / "int8", int8_kernels=True)
    names = [n.removesuffix(".weight") for n in linear_weights(ref)]
    for n in names:
        lin = q.get_submodule(n)
        assert isinstance(lin, QuantLinear), n
        w = lin.parts[0].dequantize()[:lin.out_features]
        assert torch.equal(w, ref.get_submodule(n).weight), n
    torch.manual_seed(6)
    feats, emb = torch.randn(10, 192), torch.randn(10, 64)
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    with torch.no_grad():
        outs = []
        for h in (ref, q):
            x, _, _ = h.step(h.fuse(feats), emb, torch.arange(10), None, mask)
            outs.append(h.logits(x, torch.nn.Identity()))  # [10, 64]
    want, got = outs
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    rel = (got[fin] - want[fin]).pow(2).mean().sqrt() / want[fin].pow(2).mean().sqrt()
    assert 0 < rel < 0.03, float(rel)

    save_head(head, tmp_path / "g16", quantize="int8", group_size=16)
    save_head(head, tmp_path / "float")
    for d in ("g16", "float"):
        kept = load_head(tmp_path / d, int8_kernels=True)
        assert not any(isinstance(m, QuantLinear) for m in kept.modules()), d


def test_a_new_eagle3_head_starts_from_the_targets_output_layer(tmp_path):
    from specdec.models.loader import build_model
    from specdec.train_drafter import init_from_target

    head, target_dir = tiny_eagle3(tmp_path, seed=7)
    set_draft_vocab(head, torch.randperm(64, generator=torch.Generator().manual_seed(8))[:40])
    hf = json.loads((target_dir / "config.json").read_text())
    target = build_model(hf, str(target_dir), torch.float32, torch.device("cpu"))
    init_from_target(head, target)
    rows = draft_to_target(head, torch.arange(40))
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[rows])
    assert torch.equal(head.norm.weight, target.model.norm.weight)


def test_stdlib_prompts_are_documented_functions():
    prompts = drafter_data.texts("pystdlib", 5, 2)
    assert len(prompts) == 5 and prompts == drafter_data._stdlib_prompts()[2:7]
    for p in prompts:
        last = p.rstrip().splitlines()[-1]  # the docstring's closing line
        assert "def " in p and last.endswith(('"', "'")), p[-200:]
