"""What every GPU benchmark here shares: the model shapes (random weights), an engine built on
them, the measured copy bandwidth, a check that the Triton backend works, the bytes a decode
step must read, and one timed runner step over synthetic segments.

Used by the GPU scripts of bench/ and bench/investigations/.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specdec.config import RuntimeConfig
    from verify_kernels.skinny_tiles import TileChoices

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


def run_info() -> dict:
    """What a GPU benchmark's JSON starts with: the note on weights, GPU, versions, date."""
    import datetime

    import triton

    return {"note": NOTE, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "context_tokens": CTX,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def log(*a) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def make_model_dir(root: Path, name: str, cfg: dict | None = None) -> Path:
    """config.json (`cfg`, or the named shape's) plus a word-level tokenizer sized to the
    vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = cfg or SHAPES[name]
    (d / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1").save_pretrained(
        str(d))
    return d


def bench_runtime(**fields: Any) -> RuntimeConfig:
    """The runtime switches of a benchmark (a command line): the SPECDEC_* variables, read as
    the CLIs read them (specdec.cli_options.runtime_from_env), with `fields` on top. The tuning
    cache is off unless `fields` turn it on: every benchmark run tunes its CUDA graphs afresh
    (choices kept on disk by an earlier run, or by an earlier mode of an A/B, would skip the
    tuning a run measures)."""
    from specdec.cli_options import runtime_from_env

    return runtime_from_env(**{"tuning_cache": False, **fields})


def tile_choices() -> TileChoices:
    """Few-row matmul tile choices of a script's own (the model holds its own in
    `model.kernels.tiles`), timed on first use unless SPECDEC_SKINNY_TUNE=0."""
    from verify_kernels.skinny_tiles import TileChoices

    return TileChoices(tune=bench_runtime().skinny_tune)


def build_engine(path: Path, backend: str, num_blocks: int, **runtime: Any):
    """The engine on the model at `path` on the GPU, with `bench_runtime(**runtime)`."""
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
                       speculative=SpeculativeConfig(), runtime=bench_runtime(**runtime))
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
        from specdec.attention_metadata import AttentionMetadata
        from verify_kernels.paged_attention import paged_attention
        from verify_kernels.reference import paged_attention_ref

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
    from specdec.step_inputs import Segment

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



def cuda_events(fn, steps: int, warmup: int) -> list:
    """The CUDA kernels and copies of `steps` calls of `fn` (after `warmup` untimed calls),
    recorded by torch.profiler, in start order."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
