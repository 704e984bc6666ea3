"""Block accounting with no model: reserve/commit, prefix caching, eviction, preemption."""

from __future__ import annotations

import random

from specdec.block_manager import BlockManager
from specdec.config import SchedulerConfig
from specdec.sampling_params import SamplingParams
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence


def seq(rid: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_reserve_commit_releases_rejected_slots():
    bm = BlockManager(8, 4)
    s = seq("a", list(range(6)))
    assert bm.reserve(s, 6) and len(s.block_table) == 2
    bm.commit(s, 6)
    assert bm.reserve(s, 1 + 7)  # root + a 7-node tree: slots 6..13 -> 4 blocks
    assert len(s.block_table) == 4
    bm.commit(s, 6 + 1 + 2)  # root and two nodes accepted
    assert len(s.block_table) == 3 and bm.num_used == 3
    bm.free_seq(s)
    assert bm.num_free == 8


def test_prefix_cache_hit_and_lru_eviction():
    bm = BlockManager(6, 4)
    a = seq("a", list(range(10)))
    bm.allocate_prefix(a)
    bm.reserve(a, 10)
    bm.commit(a, 10)  # blocks 0,1 full and hashed
    bm.free_seq(a)
    assert bm.num_free == 6
    b = seq("b", list(range(9)) + [99])
    assert bm.allocate_prefix(b) == 8 and b.num_cached_prompt_tokens == 8
    # The whole prompt cached still leaves its last token to compute.
    c = seq("c", list(range(8)))
    assert bm.allocate_prefix(c) == 4
    # A request that opts out (llama.cpp's cache_prompt: false) computes its whole prompt.
    e = Sequence("e", list(range(9)), SamplingParams(max_tokens=4, cache_prompt=False))
    assert bm.allocate_prefix(e) == 0 and e.num_cached_prompt_tokens == 0
    bm.free_seq(e)
    bm.free_seq(b)
    bm.free_seq(c)
    # Fill the pool: cached blocks are evicted, least recently used first.
    d = seq("d", [7] * 24)
    bm.allocate_prefix(d)
    assert bm.reserve(d, 24)
    assert bm.num_free == 0 and not bm.hash_to_block
    bm.free_seq(d)


def test_random_workload_returns_every_block():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    live: list[Sequence] = []
    for i in range(500):
        if live and rng.random() < 0.4:
            bm.free_seq(live.pop(rng.randrange(len(live))))
            continue
        s = seq(str(i), [rng.randrange(5) for _ in range(rng.randrange(1, 20))])
        bm.allocate_prefix(s)
        if not bm.reserve(s, s.num_uncomputed):
            bm.free_seq(s)
            continue
        bm.commit(s, s.num_tokens - 1)
        for _ in range(rng.randrange(4)):
            s.output_token_ids.append(rng.randrange(5))
            tree = rng.randrange(6)
            if not bm.reserve(s, 1 + tree):
                break
            bm.commit(s, s.num_computed + 1 + rng.randrange(tree + 1))
            s.output_token_ids += [1] * (s.num_computed - s.num_tokens + 1)
        live.append(s)
        assert all(bm.ref_counts[b] >= 1 for x in live for b in x.block_table)
    for s in live:
        bm.free_seq(s)
    assert bm.num_free == 40 and all(r == 0 for r in bm.ref_counts)


def test_scheduler_chunks_prefill_under_token_budget():
    bm = BlockManager(64, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), bm, 512)
    a, b = seq("a", list(range(25))), seq("b", list(range(3)))
    sch.add(a)
    plan = sch.schedule()
    assert [(p.seq.request_id, p.num_tokens) for p in plan.prefills] == [("a", 10)]
    bm.commit(a, 10)
    sch.add(b)
    # The short prompt does not wait for the long one's whole prefill: shorter prefills take up
    # to half of the budget, and the oldest one the rest.
    plan = sch.schedule()
    assert [(p.seq.request_id, p.num_tokens) for p in plan.prefills] == [("b", 3), ("a", 7)]
    assert plan.prefills[0].completes
    bm.commit(a, 17)
    bm.commit(b, 3)
    plan = sch.schedule()
    assert [(p.seq.request_id, p.num_tokens) for p in plan.prefills] == [("a", 8)]
    assert plan.prefills[0].completes and [d.seq.request_id for d in plan.decodes] == ["b"]


def test_admissions_never_starve_a_running_prefill():
    bm = BlockManager(256, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8), bm, 512)
    long = seq("long", list(range(40)))
    sch.add(long)
    sch.schedule()
    bm.commit(long, 8)
    for i in range(10):  # a new 4-token prompt every step
        sch.add(seq(f"s{i}", [1, 2, 3, 4]))
        plan = sch.schedule()
        got = {p.seq.request_id: p.num_tokens for p in plan.prefills}
        assert got.get("long", 0) >= 4 - len(plan.decodes), got
        for p in plan.prefills:
            bm.commit(p.seq, p.seq.num_computed + p.num_tokens)
        for d in plan.decodes:
            bm.commit(d.seq, d.seq.num_computed + 1)


def test_short_prompt_passes_long_running_prefills():
    # Head-of-line blocking: a short prompt behind two long prefills finishes its own within
    # two steps (shortest remaining first), while the oldest long one keeps half of every
    # step's budget.
    bm = BlockManager(256, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), bm, 512)
    longs = [seq("l1", list(range(60))), seq("l2", list(range(60)))]
    for s in longs:
        sch.add(s)
    for _ in range(2):
        for p in sch.schedule().prefills:
            bm.commit(p.seq, p.seq.num_computed + p.num_tokens)
    assert all(s.in_prefill for s in longs)
    short = seq("s", list(range(100, 108)))
    sch.add(short)
    for _ in range(2):
        plan = sch.schedule()
        got = {p.seq.request_id: p.num_tokens for p in plan.prefills}
        assert got.get("l1", 0) >= 4, got
        for p in plan.prefills:
            bm.commit(p.seq, p.seq.num_computed + p.num_tokens)
    assert not short.in_prefill and longs[1].in_prefill


def test_scheduler_shrinks_speculation_then_preempts_newest():
    bm = BlockManager(6, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), bm, 512)
    seqs = [seq(str(i), [1, 2, 3]) for i in range(3)]
    for s in seqs:
        sch.add(s)
    sch.schedule()
    for s in seqs:
        bm.commit(s, 3)
        s.output_token_ids.append(4)
    # Each wants a 7-node tree; the 8-token budget leaves 5 spare for 3 sequences.
    plan = sch.schedule({s.request_id: 7 for s in seqs})
    assert sum(d.max_draft_nodes for d in plan.decodes) <= 5
    assert plan.num_tokens <= 8


def test_scheduler_preempts_newest_when_blocks_run_out():
    bm = BlockManager(4, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, 512)
    seqs = [seq(str(i), [1, 2, 3, 4]) for i in range(3)]
    for s in seqs:
        sch.add(s)
    assert len(sch.schedule().prefills) == 3
    for s in seqs:
        bm.commit(s, 4)
        s.output_token_ids.append(5)
    # Every sequence now needs a second block; only one is free.
    plan = sch.schedule()
    assert [p.request_id for p in plan.preempted] == ["2"]
    assert [d.seq.request_id for d in plan.decodes] == ["0", "1"]
    assert seqs[2] in sch.waiting and seqs[2].num_computed == 0 and not seqs[2].block_table


def test_sequence_tokens_follow_the_output():
    """`tokens` is kept and extended as the output grows; it always reads prompt + output,
    also after either list is replaced."""
    seq = Sequence("t", [1, 2, 3], SamplingParams())
    first = seq.tokens
    assert first == [1, 2, 3]
    seq.output_token_ids += [7, 8]
    assert seq.tokens is first and first == [1, 2, 3, 7, 8]
    seq.output_token_ids += [9]
    assert seq.tokens == [1, 2, 3, 7, 8, 9]
    seq.prompt_token_ids = [4, 5]
    assert seq.tokens == [4, 5, 7, 8, 9]
    seq.output_token_ids = [6]
    assert seq.tokens == [4, 5, 6] and seq.num_tokens == 3


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_tokens():
    """A verification step commits its accepted drafts' KV before they join the sequence's
    tokens (specdec/commit.py): a block they fill is hashed once its tokens are there,
    so a later prompt that repeats the output hits it."""
    bm = BlockManager(16, 4)
    s = seq("a", list(range(6)))
    bm.allocate_prefix(s)
    bm.reserve(s, 6)
    bm.commit(s, 6)
    s.output_token_ids.append(50)  # the first sampled token: the next step's root (index 6)
    bm.reserve(s, 1 + 7)
    bm.commit(s, 6 + 1 + 3)  # the root and three drafts: KV up to index 9, tokens up to 6
    s.output_token_ids += [51, 52, 53, 54]  # the accepted drafts and the bonus token
    bm.reserve(s, 1)
    bm.commit(s, 11)  # the bonus token's KV (the next step's root)
    later = seq("b", s.tokens + [99])
    assert bm.allocate_prefix(later) == 8  # blocks [0..3] and [4, 5, 50, 51]


def test_run_only_sets_requests_aside_with_their_blocks():
    """Fault isolation (specdec/isolation.py): held requests are not scheduled, keep their
    blocks, can finish while held, and come back in arrival order."""
    bm = BlockManager(16, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, 512)
    seqs = [seq(str(i), [1, 2, 3, 4]) for i in range(4)]
    for s in seqs[:3]:
        sch.add(s)
    sch.schedule()
    sch.add(seqs[3])  # still waiting
    used = bm.num_used
    sch.run_only({"1", "3"})
    plan = sch.schedule()
    assert {p.seq.request_id for p in plan.prefills} == {"1", "3"} and not plan.decodes
    assert bm.num_used > used and all(seqs[i].block_table for i in (0, 2))
    sch.finish(seqs[2])  # aborted while held
    sch.run_only(None)
    assert [s.request_id for s in sch.running] == ["0", "1", "3"] and not sch.held
    sch.run_only(set())
    assert sch.schedule().empty and sch.has_unfinished()
    sch.run_only(None)


def test_freed_blocks_are_reused_before_untouched_ones():
    # The CPU's KV pool is committed page by page: sequences one after another, each with
    # speculative slots rejected, must keep to the blocks they hold at once, not walk the pool.
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    used: set[int] = set()
    for i in range(50):
        s = seq(str(i), list(range(6)))
        assert bm.reserve(s, 6 + 5)  # prompt and a 5-node draft: 3 blocks
        used |= set(s.block_table)
        bm.commit(s, 7)  # one token accepted: the third block goes back
        assert bm.reserve(s, 5)
        used |= set(s.block_table)
        bm.free_seq(s)
    assert len(used) == 3


def test_cached_prefixes_keep_to_the_resident_budget_and_requests_may_exceed_it():
    # With prefix caching every finished prompt's full blocks stay cached; on the CPU a cache
    # that took fresh blocks first wrote the whole pool (a server grew by 537 MB). With a
    # resident budget the cache recycles its least recently used blocks once that many blocks
    # were written; a prompt seen last is still served from the cache.
    bm = BlockManager(64, 4, resident=10)
    for i in range(40):
        s = seq(str(i), [i] * 12)  # three full blocks, distinct per prompt
        bm.allocate_prefix(s)
        assert bm.reserve(s, 12)
        bm.commit(s, 12)
        bm.free_seq(s)
    assert bm.written <= 12  # the budget, and the blocks of one prompt past it
    again = seq("again", [39] * 12 + [1])
    assert bm.allocate_prefix(again) == 12
    bm.free_seq(again)
    # A request larger than the budget still gets every block of the pool.
    big = seq("big", list(range(256)))
    bm.allocate_prefix(big)
    assert bm.reserve(big, 256) and bm.num_free == 0 and bm.written == 64
    bm.free_seq(big)
    # Without a budget (a GPU's pool, allocated whole) the cache takes fresh blocks first.
    un = BlockManager(64, 4)
    for i in range(10):
        s = seq(str(i), [i] * 12)
        un.allocate_prefix(s)
        un.reserve(s, 12)
        un.commit(s, 12)
        un.free_seq(s)
    assert un.written == 30 and len(un.cached) == 30
