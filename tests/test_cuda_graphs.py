"""The graph runner's padded inputs compute the same logits as the eager step (on the CPU,
through the reference backend); the runner's capture, tuning and replay flow on the CPU with a
stand-in for CUDA graphs (the Triton path under the interpreter); real capture on CUDA only."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from drafters.tree import DraftTree
from specdec import graph_tuning
from specdec.attention import TorchAttentionBackend
from specdec.cuda_graphs import GraphRunner
from specdec.engine import LLMEngine
from specdec.graph_tuning import heuristic_splits, split_candidates, tuning_segments
from specdec.models.loader import fused_kernels
from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.step_inputs import Layout, Segment, pack_step, padded_metadata, pick_bucket
from verify_kernels.reference import write_kv_ref


class _SkipPadding(TorchAttentionBackend):
    """The reference backend, skipping slot -1 as the Triton KV write does."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        keep = slot_mapping >= 0
        write_kv_ref(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep])


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"})


def _prefilled(engine: LLMEngine, rid: str, ids: list[int], extra: int) -> Sequence:
    seq = Sequence(rid, ids, SamplingParams())
    assert engine.blocks.reserve(seq, len(ids))
    n = len(ids) - 1  # the last prompt token becomes the root of the step under test
    seg = Segment(ids[:n], list(range(n)), [engine.blocks.slot(seq, j) for j in range(n)], 0,
                  list(seq.block_table))
    engine.runner.execute([seg])
    engine.blocks.commit(seq, n)
    assert engine.blocks.reserve(seq, 1 + extra)
    return seq


def _step_segment(engine: LLMEngine, seq: Sequence, toks: list[int], pars: list[int]) -> Segment:
    c = seq.num_computed
    tree = DraftTree.from_lists([(toks, pars)])
    depths = tree.depths.tolist()
    mask = tree.ancestor_mask(0) if toks and any(p != i - 1 for i, p in enumerate(pars)) else None
    return Segment([seq.tokens[-1]] + toks, [c] + [c + d for d in depths],
                   [engine.blocks.slot(seq, c + j) for j in range(1 + len(toks))], c,
                   list(seq.block_table), mask=mask, logits_rows=tuple(range(1 + len(toks))))


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5])
def test_padded_step_matches_eager(engine, num_seqs):
    prompts = [[3, 9, 4, 17, 22, 5, 8, 30, 31, 2], [7, 1, 12, 40, 33, 18, 6],
               [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 1, 2, 3, 4, 5],
               [8, 6, 4, 2], [9, 9, 8, 8, 7]]
    # The last two repeat the first two's shapes: segments then share a cached mask (or none).
    trees = [([11, 12, 13], [-1, -1, 0]), ([20, 21], [-1, 0]), ([], []),
             ([14, 15, 16], [-1, -1, 0]), ([22, 23], [-1, 0])]
    seqs = [_prefilled(engine, f"s{num_seqs}-{i}", prompts[i], len(trees[i][0]))
            for i in range(num_seqs)]
    segs = [_step_segment(engine, s, *trees[i]) for i, s in enumerate(seqs)]
    eager = engine.runner.execute(segs)

    width = 8
    b, q = pick_bucket(segs, width, engine.runner.block_size)
    assert b >= num_seqs and q >= max(len(s.tokens) for s in segs)
    lay = Layout(b, q, width)
    h64 = np.zeros(lay.n64, dtype=np.int64)
    h32 = np.zeros(lay.n32, dtype=np.int32)
    hmask = np.zeros(max(lay.nmask, 1), dtype=bool)
    n_rows, offsets, _ = pack_step(segs, lay, h64, h32, hmask)
    assert offsets == eager.row_offsets and n_rows == eager.logits.shape[0]
    ctx_host = tuple(int(x) for x in h32[b + 1:2 * b + 1])
    ids, pos, meta = padded_metadata(lay, torch.from_numpy(h64), torch.from_numpy(h32),
                                     torch.from_numpy(hmask), engine.runner.block_size, ctx_host)
    with torch.inference_mode():
        hidden, _ = engine.runner.model(ids, pos, meta, engine.runner.kv, _SkipPadding())
        rows = torch.from_numpy(h64[lay.rows_at:lay.rows_at + n_rows])
        logits = engine.runner.model.compute_logits(hidden.index_select(0, rows))
    torch.testing.assert_close(logits, eager.logits, rtol=1e-4, atol=1e-4)
    for s in seqs:
        engine.blocks.free_seq(s)


def test_pack_step_rewrites_only_changed_tables():
    """With the rows it last wrote, pack_step leaves the buffers as a full write would, over
    steps whose tables grow, shrink, change a block in place and lose a sequence."""
    lay = Layout(4, 2, 6)

    def seg(table):
        return Segment([1, 2], [5, 6], [7, 8], 5, table, logits_rows=(0, 1))

    steps = [[[3, 4], [5], [6, 7, 8], [9]],
             [[3, 4, 10], [5], [6, 7, 8], [9]],  # a new block
             [[3, 4], [5], [6, 11, 8], [9]],  # a block released, one replaced in place
             [[3, 4], [6, 11, 8]],  # two sequences gone
             [[2, 4, 1, 12, 13, 14], [5], [6], []]]
    bufs = [(np.full(lay.n64, -7, np.int64), np.full(lay.n32, -7, np.int32),
             np.ones(lay.nmask, bool)) for _ in range(2)]
    written: list[list[int]] = [[] for _ in range(lay.batch)]
    bufs[1][1][3 * lay.batch + 1:] = 0  # as GraphRunner._stage clears a layout's tables
    for tables in steps:
        segs = [seg(list(t)) for t in tables]
        full = pack_step(segs, lay, *bufs[0])
        assert pack_step(segs, lay, *bufs[1], written) == full
        for a, b in zip(bufs[0], bufs[1]):
            np.testing.assert_array_equal(a[:len(b)], b)
        assert written == [list(t) for t in tables] + [[]] * (lay.batch - len(tables))


def test_owner_split_follows_the_fused_tree_steps():
    """Buckets tuned with the owner program's split counts are the ones tree_attention.fuses
    takes: up to MAX_SEQS sequences of 2 to MAX_Q rows, at most MAX_PROGRAM_ROWS rows a
    program (Llama-3.1-8B's 4 query heads a KV head to 16 rows, Qwen2.5-7B's 7 to 8)."""
    from verify_kernels import tree_attention as tree

    def owner(hq, hkv, b, q):
        runner = SimpleNamespace(backend=SimpleNamespace(fused_tree=True), hq=hq, hkv=hkv)
        return GraphRunner.owner_split(runner, b, q)

    assert owner(32, 8, 1, 16) and owner(32, 8, tree.MAX_SEQS, 2)
    assert not owner(32, 8, tree.MAX_SEQS + 1, 8) and not owner(32, 8, 1, 1)
    assert owner(28, 4, 1, 8) and not owner(28, 4, 1, 16)


def test_split_candidates_are_fewer_powers_of_two():
    assert split_candidates(1) == [] and split_candidates(2) == [1]
    assert split_candidates(3) == [1, 2] and split_candidates(5) == [1, 2, 4]
    assert split_candidates(9) == [2, 4, 8] and split_candidates(8) == [2, 4]
    assert split_candidates(16) == [4, 8] and split_candidates(32) == [8, 16]
    # With an owner program (split 0 holds only the step's own columns): s + 1 as well.
    assert split_candidates(32, owner=True) == [8, 9, 16, 17]
    assert split_candidates(9, owner=True) == [2, 3, 4, 5, 8]
    assert split_candidates(2, owner=True) == [1] and split_candidates(4, owner=True) == [1, 2, 3]


@pytest.mark.parametrize("batch,q,context", [(1, 8, 40), (4, 2, 1000), (8, 1, 16)])
def test_tuning_step_reads_context_and_writes_nothing(engine, batch, q, context):
    """The placeholder step buckets are tuned on: every sequence present at the tuning context
    (capped by the block table), in blocks of its own, runs through the padded path with
    finite outputs and leaves the KV cache as it was."""
    runner, width = engine.runner, 8
    bs, nb = runner.block_size, runner.kv.shape[2]
    segs = tuning_segments(batch, q, width, bs, nb, context)
    assert pick_bucket(segs, width, bs) == (batch, q)
    ctx = min(context, width * bs - q)
    assert all(s.context_len == ctx and len(s.block_table) == -(-(ctx + q) // bs) for s in segs)
    blocks = [b for s in segs for b in s.block_table]
    assert len(set(blocks)) == min(len(blocks), nb)
    lay = Layout(batch, q, width)
    h64 = np.zeros(lay.n64, dtype=np.int64)
    h32 = np.zeros(lay.n32, dtype=np.int32)
    hmask = np.zeros(max(lay.nmask, 1), dtype=bool)
    pack_step(segs, lay, h64, h32, hmask)
    ids, pos, meta = padded_metadata(lay, torch.from_numpy(h64), torch.from_numpy(h32),
                                     torch.from_numpy(hmask), bs, (ctx,) * batch)
    kept = runner.kv.clone()
    runner.kv.normal_()  # finite garbage, as in a used cache
    before = runner.kv.clone()
    with torch.inference_mode():
        hidden, _ = runner.model(ids, pos, meta, runner.kv, _SkipPadding())
    assert torch.isfinite(hidden).all()
    assert torch.equal(runner.kv, before)
    runner.kv.copy_(kept)


def test_heuristic_splits():
    # Llama-3.1-8B heads (32 / 8) on 132 SMs, 4k tokens of block table.
    assert heuristic_splits(1, 1, 32, 8, 132, 4096) == 32
    assert heuristic_splits(1, 8, 32, 8, 132, 4096) == 32
    assert heuristic_splits(4, 8, 32, 8, 132, 4096) == 9
    assert heuristic_splits(16, 1, 32, 8, 132, 4096) == 5
    assert heuristic_splits(32, 4, 32, 8, 132, 4096) == 1  # 256 programs fill the SMs
    assert heuristic_splits(1, 32, 32, 8, 132, 4096) == 1  # rows past one query tile
    assert heuristic_splits(1, 8, 32, 8, 132, 256) == 4  # a short model: one tile each


def test_pick_bucket_limits():
    seg = Segment([1] * 3, [0, 1, 2], [0, 1, 2], 0, [0])
    assert pick_bucket([seg], 4, 16) == (1, 4)
    assert pick_bucket([seg] * 5, 4, 16) == (8, 4)
    long = Segment([1] * 100, list(range(100)), list(range(100)), 0, [0] * 7)
    assert pick_bucket([long], 8, 16) is None  # a prefill chunk runs eagerly
    assert pick_bucket([seg] * 65, 8, 16) == (96, 4)
    assert pick_bucket([seg] * 129, 8, 16) is None
    assert pick_bucket([Segment([1] * 17, list(range(17)), list(range(17)), 0, [0, 0])] * 128,
                       8, 16) is None  # 128 x 32 rows is past MAX_GRAPH_TOKENS
    deep = Segment([1], [62], [62], 62, [0] * 4)
    assert pick_bucket([deep], 4, 16) is not None
    assert pick_bucket([deep], 3, 16) is None  # its block table does not fit the width


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_matches_eager_on_cuda(tiny_llama, runtime):
    eng = LLMEngine.from_args(str(tiny_llama), device="cuda", speculative={"method": "none"},
                              num_blocks=64, runtime=runtime)
    assert eng.runner.graphs is not None
    seq = _prefilled(eng, "g", [3, 9, 4, 17, 22, 5, 8, 30], 2)
    seg = _step_segment(eng, seq, [11, 12], [-1, -1])
    graphs, eng.runner.graphs = eng.runner.graphs, None
    eager = eng.runner.execute([seg]).logits
    eng.runner.graphs = graphs
    before = graphs.replays  # the prefill above may have gone through a graph too
    for _ in range(2):  # capture, then a replay
        out = eng.runner.execute([seg]).logits
        torch.testing.assert_close(out, eager, rtol=2e-3, atol=2e-3)
    assert graphs.replays == before + 2


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Replay:
    """Stands in for a captured graph: a replay runs the runner's forward again on the staged
    inputs and writes the results into the tensors the capture returned, as a graph does."""

    def __init__(self, runner: GraphRunner, lay: Layout) -> None:
        self.runner, self.lay = runner, lay
        self.splits = runner.num_splits(lay.batch, lay.q)
        self.contexts = runner._views(runner.dbuf, lay)[1][lay.batch + 1:2 * lay.batch + 1].tolist()
        self.outs = runner.forward(lay)
        _CAPTURED.append(self)

    def replay(self) -> None:
        hidden, logits = self.runner.forward(self.lay)
        self.outs[0].copy_(hidden)
        if logits is not None:
            self.outs[1].copy_(logits)


_CAPTURED: list[_Replay] = []


def _stand_in_graphs(monkeypatch) -> None:
    """GraphRunner on the CPU: captures are _Replay objects, CUDA calls do nothing."""
    _CAPTURED.clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=8))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(GraphRunner, "capture", lambda self, lay: (
        (g := _Replay(self, lay)), g.outs))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA graphs")
def test_runner_tunes_on_placeholders_and_replays_exactly(tiny_llama, monkeypatch, runtime):
    """capture_all tunes each bucket on its placeholder step without touching the KV cache; a
    verification step in a new bucket is captured and tuned the same way before its own inputs
    are staged; it and the decode step after it run with the split counts the tuning kept
    (timed here so that one split always wins) and give the eager path's logits."""
    _stand_in_graphs(monkeypatch)
    monkeypatch.setattr(graph_tuning, "replay_ms", lambda g: 1.0 if g.splits == 1 else 2.0)
    eng = LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"},
                              attention_backend="triton", num_blocks=40)
    eng.runner.model.kernels = fused_kernels(runtime.pdl, runtime.skinny_tune)
    runner = GraphRunner(eng.runner.model, eng.runner.kv, eng.runner.backend,
                         eng.runner.block_size, 8, torch.device("cpu"),
                         replace(runtime, tune_graphs=True))
    assert runner.tune and runner.cache is None
    before = eng.runner.kv.clone()
    with torch.inference_mode():
        assert runner.capture_all(1, 2) == 2  # (1, 1) and (1, 2); (1, 4) on its first step
    assert torch.equal(eng.runner.kv, before)
    ctx = 8 * eng.runner.block_size
    seq = _prefilled(eng, "t", [3, 9, 4, 17, 22, 5, 8, 30, 31, 2, 6], 3)
    seg = _step_segment(eng, seq, [11, 12, 13], [-1, 0, 0])
    with torch.inference_mode():
        eager = eng.runner.execute([seg]).logits
        graphed = runner.execute([seg]).logits  # captured and tuned first, then replayed
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert _CAPTURED and all(g.contexts == [ctx - g.lay.q] for g in _CAPTURED)
    for q in (1, 2, 4):
        tuned = runner.tuned[(1, q)]
        assert tuned["context"] == ctx - q
        assert tuned["splits"]["heuristic"] > 1 and tuned["splits"]["chosen"] == 1
    eng.blocks.commit(seq, seq.num_computed + 2)  # the root and its first child accepted
    assert eng.blocks.reserve(seq, 1)
    step = Segment([40], [seq.num_computed], [eng.blocks.slot(seq, seq.num_computed)],
                   seq.num_computed, list(seq.block_table), logits_rows=(0,))
    with torch.inference_mode():
        eager = eng.runner.execute([step]).logits
        graphed = runner.execute([step]).logits
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert runner.replays == 2 and runner.eager_steps == 0
    # Two sequences of 2 and 3 rows in the (2, 4) bucket: the LM head is in its graph (8 rows)
    # and the rows with logits (0, 1, 4, 5, 6) are gathered from it.
    a = _prefilled(eng, "a", [5, 6, 7, 8, 9], 1)
    b = _prefilled(eng, "b", [10, 11, 12, 13, 14, 15], 2)
    segs = [_step_segment(eng, a, [21], [-1]), _step_segment(eng, b, [22, 23], [-1, -1])]
    with torch.inference_mode():
        eager = eng.runner.execute(segs)
        graphed = runner.execute(segs)
    assert graphed.row_offsets == eager.row_offsets == [0, 2]
    torch.testing.assert_close(graphed.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert runner.graphs[(2, 4)][1][1] is not None and runner.replays == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA graphs")
def test_tuned_choices_are_kept_and_reused(tiny_llama, monkeypatch, tmp_path, runtime):
    """A runner keeps its buckets' split counts and tiles on disk; the next runner of the same
    model and code loads them and captures those buckets without timing anything, with the
    same logits; another block table width or tuning context is another file; a damaged file
    is ignored."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    kept = replace(runtime, tune_graphs=True, tuning_cache=True)
    _stand_in_graphs(monkeypatch)
    timed: list[int] = []
    monkeypatch.setattr(graph_tuning, "replay_ms",
                        lambda g: timed.append(g.splits) or (1.0 if g.splits == 1 else 2.0))
    eng = LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"},
                              attention_backend="triton", num_blocks=40)
    eng.runner.model.kernels = fused_kernels(runtime.pdl, runtime.skinny_tune)

    def runner(width: int = 8, context: int = kept.tune_context) -> GraphRunner:
        return GraphRunner(eng.runner.model, eng.runner.kv, eng.runner.backend,
                           eng.runner.block_size, width, torch.device("cpu"),
                           replace(kept, tune_context=context))

    first = runner()
    assert first.cache is not None and not first.cache.exists() and not first.loaded
    with torch.inference_mode():
        first.capture_all(1, 2)
    assert timed and first.cache.exists()
    tiles = first.tiles.chosen_configs()
    assert tiles and first.splits == {(1, 1): 1, (1, 2): 1}

    # As in a new process: the model's tile choices start empty.
    eng.runner.model.kernels = fused_kernels(runtime.pdl, runtime.skinny_tune)
    timed.clear()
    second = runner()
    assert second.cache == first.cache and second.loaded == {(1, 1), (1, 2)}
    assert second.splits == first.splits and second.tiles.chosen_configs() == tiles
    seq = _prefilled(eng, "k", [3, 9, 4, 17, 22, 5, 8, 30, 31, 2, 6], 3)
    seg = _step_segment(eng, seq, [11], [-1])
    with torch.inference_mode():
        assert second.capture_all(1, 2) == 2
        eager = eng.runner.execute([seg]).logits
        graphed = second.execute([seg]).logits
    assert timed == []  # nothing timed: no split count, no tile
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    eng.blocks.free_seq(seq)

    assert runner(width=4).cache != first.cache
    assert runner(context=kept.tune_context // 2).cache != first.cache
    first.cache.write_text("{not json")
    assert runner().loaded == set()
