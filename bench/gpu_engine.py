"""The engine on one GPU: decode against the bandwidth roofline, the verification cost curve,
speculative speedup at controlled acceptance (the replay drafter), and transformers' `generate`.

Models have the exact shapes of Llama-3.1-8B and Qwen2.5-7B in bfloat16 with RANDOM weights
(`load_format="dummy"`): speed depends on shapes, not values. Run: PYTHONPATH=. python3
bench/gpu_engine.py --out DIR (bench/gpu_run.sh). Every section writes DIR/gpu_engine.json as it
finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "llama-3.1-8b-shape": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"},
    "qwen2.5-7b-shape": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"},
}
NOTE = ("All models are randomly initialised (load_format='dummy') with the exact shapes of "
        "the named models, in bfloat16: timings are representative, outputs are not text.")
CTX = 1024
T0 = time.monotonic()


def log(*a) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def make_model_dir(root: Path, name: str) -> Path:
    """config.json plus a word-level tokenizer sized to the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = SHAPES[name]
    (d / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1").save_pretrained(
        str(d))
    return d


def build_engine(path: Path, backend: str, num_blocks: int):
    from specdec.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from specdec.engine import LLMEngine
    # `path` set directly: resolve_model_path refuses a directory without safetensors.
    mc = ModelConfig(model=str(path), path=str(path), dtype="bfloat16", device="cuda",
                     load_format="dummy", max_model_len=4096)
    cfg = EngineConfig(model=mc, cache=CacheConfig(num_blocks=num_blocks,
                                                   enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
                       speculative=SpeculativeConfig())
    return LLMEngine(cfg, attention_backend=backend)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = 1 << 30  # 2 GiB of bf16 each way
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2 * n / sorted(times)[len(times) // 2]


def check_triton() -> str:
    """'triton' if its paged attention matches the reference on this GPU, else 'torch'."""
    try:
        from specdec.attention import AttentionMetadata, paged_attention_ref
        from verify_kernels.paged_attention import paged_attention

        g = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(8, 16, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        q = torch.randn(5, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        i32 = {"dtype": torch.int32, "device": "cuda"}
        meta = AttentionMetadata(
            torch.tensor([0, 1, 5], **i32), torch.tensor([40, 20], **i32),
            torch.tensor([41, 24], **i32), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], **i32),
            torch.arange(5, device="cuda"), None, torch.tensor([-1, -1], device="cuda"),
            (1, 4), (40, 20), (-1, -1), 16)
        out = paged_attention(q, kc, vc, meta, 0.125)
        ref = paged_attention_ref(q, kc, vc, meta, 0.125)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        log(f"triton paged attention vs reference: rel err {err:.2e}")
        return "triton" if err < 2e-2 else "torch"
    except Exception as e:  # any failure means: use the torch backend
        log(f"triton backend unusable here ({type(e).__name__}: {e}); using torch")
        return "torch"


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every weight except the embedding (one row is read)."""
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes(mc, ctx: int) -> int:
    return mc.num_layers * 2 * ctx * mc.num_kv_heads * mc.head_dim * 2


def tree_parents(n: int) -> list[int]:
    """A binary tree of n nodes below the root (node i's parent is (i - 1) // 2, -1 = root)."""
    return [-1 if i == 0 else (i - 1) // 2 for i in range(n)]


def step_segments(engine, batch: int, rows: int, ctx: int):
    """`batch` sequences with `ctx` tokens of (random) KV, each verifying `rows` - 1 nodes."""
    from drafters.tree import DraftTree
    from specdec.model_runner import Segment

    bs = engine.runner.block_size
    per = -(-(ctx + rows) // bs)
    segs = []
    for b in range(batch):
        table = list(range(b * per, (b + 1) * per))
        n = rows - 1
        tree = DraftTree.from_lists([(list(range(10, 10 + n)), tree_parents(n))])
        depths = tree.depths.tolist()
        slots = [table[(ctx + j) // bs] * bs + (ctx + j) % bs for j in range(rows)]
        segs.append(Segment([7] + list(range(10, 10 + n)), [ctx] + [ctx + d for d in depths],
                            slots, ctx, table, mask=tree.ancestor_mask(0) if n else None,
                            logits_rows=tuple(range(rows))))
    return segs


def time_steps(engine, segs, iters: int = 20) -> float:
    """Median-free mean seconds per runner step over `iters` back-to-back steps."""
    for _ in range(3):
        engine.runner.execute(segs)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        engine.runner.execute(segs)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def cost_curve(engine, res: dict, bw: float, batches, sizes) -> None:
    wb = weight_bytes(engine.runner.model)
    curve = {}
    for batch in batches:
        base = time_steps(engine, step_segments(engine, batch, 1, CTX))
        row = {"decode_step_ms": base * 1e3,
               "decode_roofline_ms": (wb + batch * kv_bytes(engine.config.model, CTX)) / bw * 1e3}
        for n in sizes:
            t = time_steps(engine, step_segments(engine, batch, n, CTX))
            row[str(n)] = t / base
        curve[str(batch)] = row
        log(f"cost curve batch {batch}: " + " ".join(
            f"{k}:{v:.3f}" for k, v in row.items()))
    res["verify_cost_ratio"] = curve
    res["verify_cost_ratio_note"] = ("time of one pass over n query rows per sequence (the root "
                                      "and n - 1 tree nodes) / time of a 1-row decode step")


def graph_vs_eager(engine, res: dict) -> None:
    segs = step_segments(engine, 2, 4, CTX)
    g = engine.runner.execute(segs).logits
    graphs, engine.runner.graphs = engine.runner.graphs, None
    e = engine.runner.execute(segs).logits
    t_eager = time_steps(engine, step_segments(engine, 1, 1, CTX))
    engine.runner.graphs = graphs
    res["graph_vs_eager_logits_max_abs_diff"] = float((g - e).abs().max())
    res["eager_decode_step_ms_b1"] = t_eager * 1e3


def run_requests(engine, prompts, spec: dict, max_tokens: int, tag: str):
    """(output ids per prompt, decode tokens/s after every request has its first token, tau)."""
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            speculative=spec)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final, started, t0, base = {}, set(), None, 0
    emitted = steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                final[out.request_id] = out
        if t0 is None and len(started) == len(ids):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base = sum(len(s.output_token_ids) for s in engine.seqs.values())
            base += sum(len(o.token_ids) for o in final.values())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    outs = [final[r].token_ids for r in ids]
    for r in ids:
        if final[r].spec is not None:
            emitted += final[r].spec.emitted_tokens
            steps += final[r].spec.steps
    rate = (sum(len(o) for o in outs) - base) / dt
    return outs, rate, (emitted / steps if steps else 1.0)


@torch.no_grad()
def make_greedy_stable(model) -> None:
    """Scale the embedding up and point the head at it: the model then predicts its input token
    by a wide margin, so bf16 rounding (which differs between pass shapes) never flips a greedy
    choice and a recorded script stays the target's output. Shapes and bytes are unchanged."""
    emb = model.model.embed_tokens.weight
    emb.mul_(1000.0)
    model.lm_head.weight.copy_(emb / 1000.0)


def speculative(engine, res: dict, batches, taus, k: int, tree_branches: int,
                max_tokens: int) -> None:
    from drafters import replay

    make_greedy_stable(engine.runner.model)
    res["speculative_note"] = ("random weights with the embedding scaled x1000 and the head set "
                               "to it, so greedy outputs are stable under bf16 rounding and the "
                               "replayed script stays valid (tau follows the corrupt rate)")

    g = torch.Generator().manual_seed(1)
    vocab = engine.runner.vocab_size
    out = {}
    for batch in batches:
        low = min(100, vocab // 2)
        prompts = [torch.randint(low, vocab, (CTX,), generator=g).tolist() for _ in range(batch)]
        # Untimed: the first steps at a new batch size capture graphs and tune kernel tiles.
        run_requests(engine, prompts, {"method": "none"}, 8, f"warmplain{batch}")
        _, plain_rate, _ = run_requests(engine, prompts, {"method": "none"}, max_tokens,
                                        f"plain{batch}")
        row = {"plain_tokens_per_s": plain_rate}
        log(f"batch {batch} plain: {plain_rate:.1f} tok/s")
        for shape, branches in (("chain", 1), ("tree", tree_branches)):
            base = {"method": "replay", "num_speculative_tokens": k, "branches": branches}
            # Record with every proposal rejected: the same tree shape as the replayed runs.
            replay.clear_recorded()
            recorded, rec_rate, _ = run_requests(engine, prompts, {**base, "corrupt_rate": 1.0},
                                                 max_tokens, f"rec{batch}{shape}")
            for p, o in zip(prompts, recorded):
                replay.record(p, o)
            row[f"{shape}_tau1_tokens_per_s"] = rec_rate
            if batch > 1:
                # Untimed: captures the graphs of the smaller batches that appear as requests
                # finish at different steps, so no capture falls inside a timed run.
                run_requests(engine, prompts, {**base, "corrupt_rate": replay.rate_for_tau(
                    taus[0], k)}, max_tokens, f"warm{batch}{shape}")
            for tau in taus:
                rate = replay.rate_for_tau(tau, k)
                _, r, tau_m = run_requests(engine, prompts, {**base, "corrupt_rate": rate},
                                           max_tokens, f"s{batch}{shape}{tau}")
                row[f"{shape}_tau{tau}"] = {"corrupt_rate": rate, "tau_measured": tau_m,
                                            "tokens_per_s": r, "speedup": r / plain_rate}
                log(f"batch {batch} {shape} tau {tau}: measured tau {tau_m:.2f}, "
                    f"{r:.1f} tok/s, speedup {r / plain_rate:.2f}")
        out[str(batch)] = row
    res["speculative"] = out


def hf_peer(path: Path, res: dict, new_tokens: int = 32) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, cfg.vocab_size, (1, CTX), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)
    t1, tn = gen(1), gen(new_tokens + 1)
    res["transformers_generate_b1_tokens_per_s"] = new_tokens / (tn - t1)
    log(f"transformers generate b1: {res['transformers_generate_b1_tokens_per_s']:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=380.0)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    report = {
        "note": NOTE, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "context_tokens": CTX, "models": {},
    }

    def save() -> None:
        (out_dir / "gpu_engine.json").write_text(json.dumps(report, indent=1))

    bw = copy_bandwidth()
    report["copy_bandwidth_bytes_per_s"] = bw
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    backend = check_triton()
    report["attention_backend"] = backend
    save()
    tmp = Path(tempfile.mkdtemp())
    for mi, name in enumerate(args.models.split(",")):
        def left() -> float:
            return args.budget_s - (time.monotonic() - T0)

        if left() < 60:
            log(f"skipping {name}: out of time")
            break
        res: dict = {}
        report["models"][name] = res
        path = make_model_dir(tmp, name)
        engine = build_engine(path, backend, num_blocks=2600)
        log(f"{name}: built")
        m = engine.runner.model
        res["weight_bytes_per_step"] = weight_bytes(m)
        res["kv_bytes_per_seq_at_ctx"] = kv_bytes(engine.config.model, CTX)
        res["cuda_graphs"] = engine.runner.graphs is not None
        floor = (res["weight_bytes_per_step"] + res["kv_bytes_per_seq_at_ctx"]) / bw
        res["decode_b1_roofline_tokens_per_s"] = 1 / floor
        engine.runner.kv.normal_()  # attention over finite, non-zero KV
        sizes = (2, 4, 8, 16, 32, 64) if mi == 0 else (2, 4, 8, 16)
        batches = (1, 8, 32) if mi == 0 else (1,)
        cost_curve(engine, res, bw, batches, sizes)
        b1 = res["verify_cost_ratio"]["1"]["decode_step_ms"] / 1e3
        res["decode_b1_runner_step_fraction_of_roofline"] = floor / b1
        if engine.runner.graphs is not None:
            graph_vs_eager(engine, res)
        save()
        if left() > 120:
            from drafters import replay

            prompt = torch.randint(100, engine.runner.vocab_size, (CTX,)).tolist()
            replay.clear_recorded()
            _, r, _ = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens, "dec")
            res["decode_b1_engine_tokens_per_s"] = r
            res["decode_b1_engine_fraction_of_roofline"] = r * floor
            log(f"{name}: engine decode b1 {r:.1f} tok/s = {r * floor:.0%} of roofline")
            save()
            sb = (1, 16) if mi == 0 else (1,)
            taus = (2, 3, 4, 5) if mi == 0 else (3,)
            speculative(engine, res, sb, taus, k=7, tree_branches=2, max_tokens=args.max_tokens)
            save()
        if engine.runner.graphs is not None:
            res["graph_buckets_captured"] = sorted(map(list, engine.runner.graphs.graphs))
        del engine, m
        torch.cuda.empty_cache()
        if left() > 45:
            try:
                hf_peer(path, res)
                torch.cuda.empty_cache()
            except Exception as e:
                res["transformers_generate_error"] = f"{type(e).__name__}: {e}"
                log(res["transformers_generate_error"])
        save()
    print_table(report)


def print_table(report: dict) -> None:
    print("\n== gpu_engine:", report["gpu"], "torch", report["torch"], "triton",
          report["triton"], "| backend", report.get("attention_backend"), "| RANDOM WEIGHTS")
    print(f"copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    for name, r in report["models"].items():
        print(f"-- {name}")
        for k in ("decode_b1_roofline_tokens_per_s", "decode_b1_runner_step_fraction_of_roofline",
                  "decode_b1_engine_tokens_per_s", "decode_b1_engine_fraction_of_roofline",
                  "eager_decode_step_ms_b1", "graph_vs_eager_logits_max_abs_diff",
                  "transformers_generate_b1_tokens_per_s"):
            if k in r:
                print(f"   {k}: {r[k]:.4g}")
        for b, row in r.get("verify_cost_ratio", {}).items():
            print(f"   cost b{b}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()))
        for b, row in r.get("speculative", {}).items():
            cells = [f"plain {row['plain_tokens_per_s']:.0f}/s"]
            for k, v in row.items():
                if isinstance(v, dict):
                    cells.append(f"{k}: tau {v['tau_measured']:.2f} x{v['speedup']:.2f}")
            print(f"   spec b{b}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
