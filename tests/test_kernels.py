"""Triton kernels against their PyTorch references.

On a machine without CUDA the kernels run in Triton's interpreter in float32. With
SPECDEC_TEST_DEVICE=cuda they run on the GPU in bfloat16 (attention and KV ops) against the
float32 reference of the same bf16 data.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if ON_CUDA and not torch.cuda.is_available():
    pytest.skip("SPECDEC_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

import triton  # noqa: E402,F401  (imported after TRITON_INTERPRET is settled)

from drafters.tree import DraftTree  # noqa: E402
from specdec.attention import TorchAttentionBackend  # noqa: E402
from specdec.attention_metadata import AttentionMetadata  # noqa: E402
from verify_kernels.acceptance import accept_tree  # noqa: E402
from verify_kernels.backend import TritonAttentionBackend  # noqa: E402
from verify_kernels.kv_ops import compact_kv, compact_kv_ref, write_kv  # noqa: E402
from verify_kernels.paged_attention import paged_attention  # noqa: E402
from verify_kernels.reference import paged_attention_ref, verify_tree, write_kv_ref  # noqa: E402

DEV = torch.device("cuda" if ON_CUDA else "cpu")
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
ATOL = 4e-2 if ON_CUDA else 2e-5


def random_tree(g: torch.Generator, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """Random parents (each before its child) and distinct sibling tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        used = {t for t, q in zip(tokens, parents) if q == p}
        t = int(torch.randint(0, vocab, (1,), generator=g))
        while t in used:
            t = (t + 1) % vocab
        tokens.append(t)
        parents.append(p)
    return tokens, parents


def make_meta(
    specs: list[tuple[int, int | list[int]]],  # (context_len, q_len or tree parents)
    block_size: int,
    g: torch.Generator,
) -> tuple[AttentionMetadata, int]:
    """Metadata over shuffled blocks; a list of parents makes a tree of 1 + n query rows."""
    bsz = len(specs)
    ctxs = [c for c, _ in specs]
    qlens = [q if isinstance(q, int) else 1 + len(q) for _, q in specs]
    max_blocks = max((c + q + block_size - 1) // block_size for c, q in zip(ctxs, qlens))
    num_blocks = bsz * max_blocks + 2
    perm = torch.randperm(num_blocks, generator=g).int()
    tables = torch.zeros(bsz, max_blocks, dtype=torch.int32)
    masks, offs, slots, off = [], [], [], 0
    for b, ((c, spec), q) in enumerate(zip(specs, qlens)):
        need = (c + q + block_size - 1) // block_size
        tables[b, :need] = perm[b * max_blocks:b * max_blocks + need]
        if isinstance(spec, int):
            offs.append(-1)
        else:
            tree = DraftTree.from_lists([(list(range(len(spec))), spec)])
            masks.append(tree.ancestor_mask(0).flatten())
            offs.append(off)
            off += q * q
        slots += [int(tables[b, j // block_size]) * block_size + j % block_size
                  for j in range(c, c + q)]
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([c + q for c, q in zip(ctxs, qlens)], dtype=torch.int32,
                              device=DEV),
        block_tables=tables.to(DEV),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        custom_mask=torch.cat(masks).to(DEV) if masks else None,
        mask_offsets=torch.tensor(offs, dtype=torch.int64, device=DEV),
        q_lens_host=tuple(qlens),
        context_lens_host=tuple(ctxs),
        mask_offsets_host=tuple(offs),
        block_size=block_size,
    )
    return meta, num_blocks


def run_attention(specs, hq: int, hkv: int, d: int, bs: int, seed: int,
                  num_splits: int | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    meta, nb = make_meta(specs, bs, g)
    t = sum(meta.q_lens_host)
    q = torch.randn(t, hq, d, generator=g).to(DEV, DTYPE)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    out = paged_attention(q, k_cache, v_cache, meta, num_splits=num_splits)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 4, 64, 16), (8, 2, 128, 32), (6, 2, 64, 32),
                                         (7, 1, 128, 16)])
def test_decode_batch(hq, hkv, d, bs):
    specs = [(c, 1) for c in (0, 1, 15, 16, 33, 90)]
    run_attention(specs, hq, hkv, d, bs, seed=hq * d + bs)


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 2, 64, 16), (4, 1, 128, 32)])
def test_prefill_chunks(hq, hkv, d, bs):
    # Fresh prompts, chunks after a paged prefix, and a chunk long enough for several q tiles.
    specs = [(0, 37), (45, 20), (13, 150), (64, 3)]
    run_attention(specs, hq, hkv, d, bs, seed=d + bs)


@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32)])
def test_tree_verify(d, bs):
    g = torch.Generator().manual_seed(d)
    specs = [(c, random_tree(g, n, 100)[1]) for c, n in ((0, 5), (17, 9), (40, 1), (70, 16))]
    specs.append((31, list(range(-1, 6))))  # a chain
    run_attention(specs, 8, 2, d, bs, seed=bs)


@pytest.mark.parametrize("seed", range(4))
def test_mixed_random_batch(seed):
    g = torch.Generator().manual_seed(100 + seed)
    hkv = [1, 2, 4][seed % 3]
    hq = hkv * [1, 2, 4, 3][seed]
    d, bs = [64, 128][seed % 2], [16, 32][seed // 2]
    specs: list[tuple[int, int | list[int]]] = []
    for _ in range(int(torch.randint(3, 7, (1,), generator=g))):
        ctx = int(torch.randint(0, 80, (1,), generator=g))
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0:
            specs.append((ctx, 1))
        elif kind == 1:
            specs.append((ctx, int(torch.randint(2, 40, (1,), generator=g))))
        else:
            specs.append((ctx, random_tree(g, int(torch.randint(1, 12, (1,), generator=g)),
                                           50)[1]))
    run_attention(specs, hq, hkv, d, bs, seed=seed)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 32])
def test_split_kv(num_splits):
    g = torch.Generator().manual_seed(num_splits)
    # Long and short contexts (short ones leave partitions empty), a tree and a prefill chunk.
    specs = [(300, 1), (5, 1), (190, random_tree(g, 6, 50)[1]), (129, 1), (60, 45)]
    run_attention(specs, 8, 2, 64, 16, seed=num_splits, num_splits=num_splits)
    run_attention([(250, 1), (97, 1)], 4, 4, 128, 32, seed=7, num_splits=num_splits)


def test_launch_path_never_reads_device_values(monkeypatch):
    g = torch.Generator().manual_seed(0)
    meta, nb = make_meta([(20, 1), (3, 9), (11, [-1, 0, 0])], 16, g)
    q = torch.randn(sum(meta.q_lens_host), 4, 64, generator=g).to(DEV, DTYPE)
    cache = torch.randn(nb, 16, 2, 64, generator=g).to(DEV, DTYPE)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("device value read in the launch path")

    if ON_CUDA:  # the interpreter itself copies tensors to the host
        monkeypatch.setattr(torch.Tensor, "item", forbidden)
        monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    paged_attention(q, cache, cache, meta)


def test_write_kv():
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, d, t = 6, 16, 3, 64, 21
    qkv = torch.randn(t, 8, d, generator=g).to(DEV, DTYPE)
    k, v = qkv[:, 2:5], qkv[:, 5:8]  # strided views, as sliced from a fused projection
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
    caches = [torch.zeros(nb, bs, hkv, d, device=DEV, dtype=DTYPE) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots)
    write_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    skip = slots.clone()
    skip[::3] = -1  # padded rows are skipped
    write_kv(k * 2, v * 2, caches[0], caches[1], skip)
    keep = skip >= 0
    write_kv_ref(k[keep] * 2, v[keep] * 2, caches[2], caches[3], skip[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("bs,shuffle", [(16, True), (32, False)])
def test_compact_kv(bs, shuffle):
    g = torch.Generator().manual_seed(bs)
    layers, nb, hkv, d = 3, 8, 2, 64
    kv = torch.randn(layers, 2, nb, bs, hkv, d, generator=g).to(DEV, DTYPE)
    src, dst = [], []
    base = 0
    for n_nodes, path in ((9, [0, 2, 5, 8]), (5, [1, 2, 3, 4]), (6, [0]), (12, [3, 4, 7, 9, 11])):
        for k, node in enumerate(path):  # node i sits at base + 1 + i, moves to base + 1 + k
            src.append(base + 1 + node)
            dst.append(base + 1 + k)
        base += n_nodes + 1 + int(torch.randint(0, 5, (1,), generator=g))
    chain = list(range(base, base + 20))  # a long overlapping chain: shift down by one
    src += [s + 1 for s in chain]
    dst += chain
    if not shuffle:  # runs per sequence, the sequences in descending slot order
        cut = [0, 4, 8, 9, 14, len(src)]
        runs = [(src[a:b], dst[a:b]) for a, b in zip(cut, cut[1:])][::-1]
        src, dst = [x for r, _ in runs for x in r], [x for _, r in runs for x in r]
    src_t = torch.tensor(src, dtype=torch.int64)
    dst_t = torch.tensor(dst, dtype=torch.int64)
    if shuffle:
        perm = torch.randperm(len(src), generator=g)
        src_t, dst_t = src_t[perm], dst_t[perm]
    expect = kv.clone()
    compact_kv_ref(expect, src_t.to(DEV), dst_t.to(DEV))
    compact_kv(kv, src_t.to(DEV), dst_t.to(DEV), sorted_by_dst=not shuffle)
    assert torch.equal(kv, expect)


def test_backend_matches_torch_backend():
    g = torch.Generator().manual_seed(5)
    meta, nb = make_meta([(12, 1), (0, 9), (30, [-1, 0, 1, 0])], 16, g)
    t, layers, hkv, d = sum(meta.q_lens_host), 2, 2, 64
    kv = torch.randn(layers, 2, nb, 16, hkv, d, generator=g).to(DEV, DTYPE)  # the engine layout
    kv_ref = kv.float()
    q, k, v = (torch.randn(t, h, d, generator=g).to(DEV, DTYPE) for h in (4, hkv, hkv))
    tri, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert tri.name == "triton"
    tri.write_kv(k, v, kv[1, 0], kv[1, 1], meta.slot_mapping)
    torch_backend.write_kv(k.float(), v.float(), kv_ref[1, 0], kv_ref[1, 1], meta.slot_mapping)
    assert torch.equal(kv.float(), kv_ref)
    out = tri.attend(q, kv[1, 0], kv[1, 1], meta, 0.1)
    expect = torch_backend.attend(q.float(), kv_ref[1, 0], kv_ref[1, 1], meta, 0.1)
    torch.testing.assert_close(out.float(), expect, atol=ATOL, rtol=ATOL)


def _acceptance_case(seed: int, vocab: int, mode: str):
    """mode: 'greedy', 'sampled' (draft probs everywhere) or 'mixed'."""
    g = torch.Generator().manual_seed(seed)
    bsz = int(torch.randint(1, 6, (1,), generator=g))
    sizes = [int(torch.randint(0, 9, (1,), generator=g)) for _ in range(bsz)]
    trees = [random_tree(g, n, vocab) for n in sizes]
    rows = torch.tensor([n + 1 for n in sizes])
    row_offsets = torch.cumsum(rows, 0) - rows
    probs = torch.softmax(torch.randn(int(rows.sum()), vocab, generator=g) * 3, dim=-1)
    for b, (toks, pars) in enumerate(trees):  # lift draft tokens so that paths get accepted
        for t, p in zip(toks, pars):
            probs[row_offsets[b] + p + 1, t] += float(torch.rand(1, generator=g)) * 2
    draft = None
    if mode != "greedy":
        draft = []
        for b, n in enumerate(sizes):
            if mode == "mixed" and b % 2:
                draft.append(None)
                continue
            q = torch.rand(n, vocab, generator=g) ** 4
            draft.append(q / q.sum(-1, keepdim=True))
    tree = DraftTree.from_lists(trees, draft, vocab)
    greedy = torch.full((bsz,), mode == "greedy")
    if mode == "mixed":
        greedy = torch.rand(bsz, generator=g) < 0.3
    if mode == "greedy" and seed % 2:  # one-hot rows, as process_logits makes for greedy
        probs = torch.zeros_like(probs).scatter_(1, probs.argmax(-1, keepdim=True), 1.0)
    nu = torch.rand(tree.num_nodes, generator=g)
    bu = torch.rand(bsz, generator=g)
    return probs, row_offsets, tree, greedy, nu, bu


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("vocab", [50, 3001])
def test_acceptance(mode, vocab):
    for seed in range(6 if vocab < 1000 else 2):
        probs, row_offsets, tree, greedy, nu, bu = _acceptance_case(seed, vocab, mode)
        ref = verify_tree(probs, row_offsets, tree, greedy, nu, bu)
        out = accept_tree(probs.to(DEV), row_offsets.to(DEV), tree, greedy.to(DEV),
                          nu.to(DEV), bu.to(DEV))
        assert torch.equal(out.tokens.cpu(), ref.tokens), (seed, out.tokens, ref.tokens)
        assert torch.equal(out.num_tokens.cpu(), ref.num_tokens)
        assert torch.equal(out.accepted_nodes.cpu(), ref.accepted_nodes)


def test_acceptance_empty_trees():
    probs = torch.softmax(torch.randn(3, 40), dim=-1)
    tree = DraftTree.empty(3)
    args = (torch.arange(3), tree, torch.tensor([True, False, False]), torch.zeros(0),
            torch.tensor([0.1, 0.5, 0.9]))
    ref = verify_tree(probs, *args)
    out = accept_tree(probs.to(DEV), *[a.to(DEV) if isinstance(a, torch.Tensor) else a
                                        for a in args])
    assert torch.equal(out.tokens.cpu(), ref.tokens) and out.tokens.shape == (3, 1)
    assert torch.equal(out.num_tokens.cpu(), ref.num_tokens)
