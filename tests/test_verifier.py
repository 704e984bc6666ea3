"""verify_tree on small vocabularies: greedy path-following, result shapes and padding, and
Monte Carlo checks that the emitted tokens are distributed exactly as the target's rows.

Statistical tests run one verify_tree call over thousands of identical copies of a sequence
(each copy with its own draft samples and uniforms) and compare the histogram of what was
emitted with the target by a chi-square test at fixed seeds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from scipy.stats import chisquare

from drafters.tree import DraftTree, chain
from verify_kernels import reference as verifier
from verify_kernels.reference import VerifyResult, verify_tree

V = 7
COPIES = 20000
ALPHA = 1e-3

Verify = Callable[..., VerifyResult]


def chisquare_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities, merging the smallest bins
    until every bin expects at least 5. An outcome of probability 0 that occurs gives 0."""
    obs = observed.double().flatten()
    exp = expected_probs.double().flatten()
    exp = exp / exp.sum() * obs.sum()
    if bool((obs[exp == 0] > 0).any()):
        return 0.0
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    order = exp.argsort()
    obs, exp = obs[order], exp[order]
    cum = exp.cumsum(0)
    cut = int((cum < 5).sum()) + 1  # the smallest bins, merged, expect at least 5
    if cut >= len(exp) - 1:
        cut = len(exp) - 2
    obs = torch.cat([obs[:cut].sum()[None], obs[cut:]])
    exp = torch.cat([exp[:cut].sum()[None], exp[cut:]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def random_rows(n: int, seed: int, skew: float = 1.0) -> torch.Tensor:
    """[n, V] strictly positive distributions."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(skew * torch.randn(n, V, generator=g, dtype=torch.float64), -1).float()


def batch_probs(rows: torch.Tensor, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target rows of one sequence (root first) repeated per copy: ([copies * R, V], [copies])."""
    r = rows.shape[0]
    return rows.repeat(copies, 1), torch.arange(copies, dtype=torch.long) * r


def run(
    rows: torch.Tensor,  # [1 + n, V] target rows: the root, then node i at row 1 + i
    trees: Sequence[tuple[Sequence[int], Sequence[int]]],  # one per copy, all shaped alike
    draft_probs: Sequence[torch.Tensor | None] | None = None,
    seed: int = 0,
    greedy: bool = False,
    verify: Verify = verify_tree,
) -> VerifyResult:
    copies = len(trees)
    tree = DraftTree.from_lists(trees, draft_probs, V)
    probs, offsets = batch_probs(rows, copies)
    g = torch.Generator().manual_seed(seed)
    node_u = torch.rand(tree.num_nodes, generator=g)
    bonus_u = torch.rand(copies, generator=g)
    flags = torch.full((copies,), greedy, dtype=torch.bool)
    return verify(probs, offsets, tree, flags, node_u, bonus_u)


def first_token_p(res: VerifyResult, p: torch.Tensor) -> float:
    return chisquare_p(torch.bincount(res.tokens[:, 0], minlength=V), p)


# -- greedy and shapes ------------------------------------------------------------------------

def greedy_rows(argmaxes: Sequence[int]) -> torch.Tensor:
    rows = torch.full((len(argmaxes), V), 0.1)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return rows / rows.sum(-1, keepdim=True)


@pytest.mark.parametrize("greedy_flag", [True, False])
def test_greedy_chain_follows_argmax_then_bonus(greedy_flag):
    # Root argmax 3; node 0 (token 3) argmax 5; node 1 (token 5) argmax 2; node 2 (token 4).
    rows = greedy_rows([3, 5, 2, 6])
    if not greedy_flag:  # one-hot rows sampled with any uniforms act the same
        rows = torch.nn.functional.one_hot(rows.argmax(-1), V).float()
    res = run(rows, [chain([3, 5, 4])], greedy=greedy_flag)
    assert res.tokens.tolist() == [[3, 5, 2, -1]]
    assert res.num_tokens.tolist() == [3]
    assert res.accepted_nodes.tolist() == [[0, 1, -1]]


def test_greedy_full_acceptance_emits_bonus_argmax():
    rows = greedy_rows([3, 5, 2, 6])
    res = run(rows, [chain([3, 5, 2])], greedy=True)
    assert res.tokens.tolist() == [[3, 5, 2, 6]]
    assert res.num_tokens.tolist() == [4]
    assert res.accepted_nodes.tolist() == [[0, 1, 2]]


def test_greedy_tree_takes_matching_second_sibling():
    # Root children: node 0 (token 1) and node 1 (token 4, the argmax); node 1's children:
    # node 2 (token 0) and node 3 (token 6, the argmax at node 1); node 0 has child node 4.
    tokens, parents = [1, 4, 0, 6, 2], [-1, -1, 1, 1, 0]
    argmaxes = [4, 2, 6, 1, 3, 2]  # rows: root, then nodes 0..4
    res = run(greedy_rows(argmaxes), [(tokens, parents)], greedy=True)
    assert res.accepted_nodes.tolist() == [[1, 3]]
    assert res.tokens.tolist() == [[4, 6, 3]]  # node 3's row gives the bonus
    assert res.num_tokens.tolist() == [3]


def test_greedy_lists_agree_with_verify_tree():
    """The host-list greedy rule (all-greedy batches) gives verify_tree's greedy result on
    random ragged batches of random trees."""
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        trees, argmax, roots = [], [], []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            n = int(torch.randint(0, 7, (1,), generator=g))
            parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
            tokens = [int(t) for t in torch.randperm(V, generator=g)[:n]]
            roots.append(len(argmax))
            argmax += [int(torch.randint(0, V, (1,), generator=g)) for _ in range(n + 1)]
            trees.append((tokens, parents))
        # Steer some rows onto a child's token so that paths get accepted.
        for (tokens, parents), r0 in zip(trees, roots):
            for i, p in enumerate(parents):
                if torch.rand(1, generator=g) < 0.6:
                    argmax[r0 + p + 1] = tokens[i]
        tree = DraftTree.from_lists(trees, None, V)
        ones = torch.ones(len(trees), dtype=torch.bool)
        res = verify_tree(greedy_rows(argmax), torch.tensor(roots), tree, ones,
                          torch.zeros(tree.num_nodes), torch.zeros(len(trees)))
        emitted, accepted = verifier.verify_greedy_lists(argmax, trees, roots)
        for b in range(len(trees)):
            k = int(res.num_tokens[b])
            assert emitted[b] == res.tokens[b, :k].tolist()
            assert accepted[b] == res.accepted_nodes[b, :k - 1].tolist()


def test_greedy_ignores_uniforms():
    rows = greedy_rows([3, 5, 2, 6])
    tree = DraftTree.from_lists([chain([3, 5, 1])] * 2, vocab_size=V)
    probs, offsets = batch_probs(rows, 2)
    greedy = torch.tensor([True, True])
    a = verify_tree(probs, offsets, tree, greedy, torch.zeros(3 * 2), torch.zeros(2))
    b = verify_tree(probs, offsets, tree, greedy, torch.full((6,), 0.999), torch.full((2,), 0.999))
    assert a.tokens.tolist() == b.tokens.tolist() == [[3, 5, 2, -1]] * 2


def test_ragged_batch_shapes_and_padding():
    # Sequences with 0, 1 and 3 nodes (depths 0, 1, 2) verified together; mixed greedy flags.
    trees = [([], []), ([2], [-1]), ([3, 5, 1], [-1, 0, -1])]
    sizes = [len(t) for t, _ in trees]
    argmaxes = [[4], [2, 6], [3, 5, 0, 4]]
    rows = torch.cat([greedy_rows(a) for a in argmaxes])
    offsets = torch.tensor([0, 1, 3])  # a sequence has 1 + n rows
    tree = DraftTree.from_lists(trees, vocab_size=V)
    res = verify_tree(rows, offsets, tree, torch.tensor([True, True, True]),
                      torch.zeros(sum(sizes)), torch.zeros(3))
    assert res.tokens.shape == (3, 3) and res.accepted_nodes.shape == (3, 2)
    assert res.tokens.dtype == res.num_tokens.dtype == res.accepted_nodes.dtype == torch.long
    assert res.tokens.tolist() == [[4, -1, -1], [2, 6, -1], [3, 5, 0]]
    assert res.num_tokens.tolist() == [1, 2, 3]
    assert res.accepted_nodes.tolist() == [[-1, -1], [0, -1], [0, 1]]


def test_empty_batch_of_trees_emits_one_token_each():
    rows = greedy_rows([4, 1, 6])
    res = verify_tree(rows, torch.arange(3), DraftTree.empty(3), torch.tensor([True] * 3),
                      torch.zeros(0), torch.zeros(3))
    assert res.tokens.tolist() == [[4], [1], [6]]
    assert res.num_tokens.tolist() == [1, 1, 1]
    assert res.accepted_nodes.shape == (3, 0)


def test_padding_invariants_under_sampling():
    rows = random_rows(4, seed=3)
    res = run(rows, [chain([1, 2, 3])] * 2000, seed=4)
    n = res.num_tokens
    cols = torch.arange(4)[None, :]
    assert bool(((res.tokens >= 0) == (cols < n[:, None])).all())
    acc_cols = torch.arange(3)[None, :]
    assert bool(((res.accepted_nodes >= 0) == (acc_cols < (n - 1)[:, None])).all())
    # Accepted nodes of a chain are its prefix, and their tokens are the emitted ones.
    assert bool(((res.accepted_nodes == acc_cols) | (res.accepted_nodes < 0)).all())
    chain_tok = torch.tensor([1, 2, 3])[None, :].expand(2000, 3)
    acc = res.accepted_nodes >= 0
    assert bool((res.tokens[:, :3][acc] == chain_tok[acc]).all())


def test_bonus_never_picks_zero_probability_tokens():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0 - 2.0 ** -24])
    res = verify_tree(p.repeat(5, 1), torch.arange(5), DraftTree.empty(5),
                      torch.zeros(5, dtype=torch.bool), torch.zeros(0), u)
    assert res.tokens[:, 0].tolist() == [1, 1, 3, 3, 3]


# -- exactness by Monte Carlo ----------------------------------------------------------------

def sample_chains(q_rows: torch.Tensor, copies: int, depth: int, seed: int
                  ) -> tuple[list[tuple[list[int], list[int]]], list[torch.Tensor]]:
    """Chains drawn from a draft model whose next-token row depends on the previous token:
    q_rows[0] at the root, q_rows[1 + t] after token t. Returns trees and per-node q rows."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((copies,), -1, dtype=torch.long)
    toks, qs = [], []
    for _ in range(depth):
        q = q_rows[prev + 1]  # [copies, V]
        prev = torch.multinomial(q, 1, generator=g).squeeze(1)
        toks.append(prev)
        qs.append(q)
    toks_t = torch.stack(toks, 1).tolist()
    q_t = torch.stack(qs, 1)  # [copies, depth, V]
    return [chain(t) for t in toks_t], list(q_t)


def chain_target_rows(p_rows: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """Target rows of a chain: the root row, then the row after each node's token."""
    return torch.stack([p_rows[0]] + [p_rows[1 + t] for t in tokens])


def run_stochastic_chains(verify: Verify = verify_tree, seed: int = 10) -> float:
    # Per-copy chains differ, so rows are gathered per copy rather than repeated.
    p_rows = random_rows(1 + V, seed=seed)
    q_rows = random_rows(1 + V, seed=seed + 1, skew=1.5)
    trees, q = sample_chains(q_rows, COPIES, depth=2, seed=seed + 2)
    rows = torch.cat([chain_target_rows(p_rows, t) for t, _ in trees])
    offsets = torch.arange(COPIES) * 3
    g = torch.Generator().manual_seed(seed + 3)
    tree = DraftTree.from_lists(trees, q, V)
    res = verify(rows, offsets, tree, torch.zeros(COPIES, dtype=torch.bool),
                 torch.rand(tree.num_nodes, generator=g), torch.rand(COPIES, generator=g))
    assert 0 < int((res.num_tokens > 1).sum()) < COPIES  # both outcomes are exercised
    return first_token_p(res, p_rows[0])


def test_stochastic_chain_first_token_is_target():
    assert run_stochastic_chains() > ALPHA


def test_point_mass_chain_first_token_is_target():
    rows = random_rows(4, seed=20)
    res = run(rows, [chain([2, 4, 1])] * COPIES, seed=21)
    assert first_token_p(res, rows[0]) > ALPHA


def test_deterministic_siblings_first_token_is_target():
    rows = random_rows(4, seed=30)
    res = run(rows, [([5, 0, 3], [-1, -1, -1])] * COPIES, seed=31)
    assert first_token_p(res, rows[0]) > ALPHA


def sample_siblings(q: torch.Tensor, copies: int, k: int, seed: int
                    ) -> tuple[list[tuple[list[int], list[int]]], list[torch.Tensor]]:
    """k distinct siblings drawn from q one after another, each from q renormalised over the
    tokens not yet drawn (the distribution it was drawn from is its draft-probability row)."""
    g = torch.Generator().manual_seed(seed)
    left = q[None, :].repeat(copies, 1)  # [copies, V]
    toks, rows = [], []
    for _ in range(k):
        row = left / left.sum(-1, keepdim=True)
        t = torch.multinomial(row, 1, generator=g).squeeze(1)
        toks.append(t)
        rows.append(row)
        left = left.scatter(1, t[:, None], 0.0)
    toks_t = torch.stack(toks, 1).tolist()
    return [(t, [-1] * k) for t in toks_t], list(torch.stack(rows, 1))


def test_stochastic_siblings_first_token_is_target():
    p = random_rows(1, seed=40)[0]
    q = random_rows(1, seed=41, skew=2.0)[0]
    trees, q_rows = sample_siblings(q, COPIES, k=3, seed=42)
    res = run(p[None, :].repeat(4, 1), trees, q_rows, seed=43)
    assert first_token_p(res, p) > ALPHA


def test_depth_two_tree_joint_of_first_two_tokens():
    # Root children a=2 (node 0) and b=5 (node 1), deterministic; a has children 1 and 4,
    # b has child 6. The first token is the root row's; given that it is an accepted node n,
    # the second is drawn from node n's row; otherwise only one token is emitted.
    tokens, parents = [2, 5, 1, 4, 6], [-1, -1, 0, 0, 1]
    rows = random_rows(6, seed=60)
    res = run(rows, [(tokens, parents)] * COPIES, seed=61)
    x1, x2 = res.tokens[:, 0], res.tokens[:, 1]
    in_tree = (x1 == 2) | (x1 == 5)
    assert bool((res.num_tokens[~in_tree] == 1).all())
    assert bool((res.num_tokens[in_tree] >= 2).all())
    # Outcome bins: (x1, x2) for x1 in {a, b}, x1 alone otherwise.
    node_row = {2: 1, 5: 2}
    exp = torch.zeros(V, V + 1)
    for t in range(V):
        if t in node_row:
            exp[t, :V] = rows[0, t] * rows[node_row[t]]
        else:
            exp[t, V] = rows[0, t]
    col = torch.where(in_tree, x2, torch.full_like(x2, V))
    obs = torch.bincount(x1 * (V + 1) + col, minlength=V * (V + 1))
    assert chisquare_p(obs, exp) > ALPHA


def test_depth_two_stochastic_chain_joint_of_first_two_tokens():
    # Node 0 ~ q0 is accepted with probability min(1, p0 / q0), so x1 = t is an accepted node
    # with probability min(p0(t), q0(t)) and then x2 follows the target row after t; the rest
    # of p0(t) is a recovered x1, after which the step emits nothing more.
    p_rows = random_rows(1 + V, seed=70)
    q_rows = random_rows(1 + V, seed=71, skew=1.5)
    trees, q = sample_chains(q_rows, COPIES, depth=2, seed=72)
    rows = torch.cat([chain_target_rows(p_rows, t) for t, _ in trees])
    tree = DraftTree.from_lists(trees, q, V)
    g = torch.Generator().manual_seed(73)
    res = verify_tree(rows, torch.arange(COPIES) * 3, tree, torch.zeros(COPIES, dtype=torch.bool),
                      torch.rand(tree.num_nodes, generator=g), torch.rand(COPIES, generator=g))
    x1, x2 = res.tokens[:, 0], res.tokens[:, 1]
    accepted = res.num_tokens > 1
    assert bool((x1[accepted] == torch.tensor([t[0] for t, _ in trees])[accepted]).all())
    both = torch.minimum(p_rows[0], q_rows[0])  # [V]
    exp = torch.cat([both[:, None] * p_rows[1:], (p_rows[0] - both)[:, None]], dim=1)
    col = torch.where(accepted, x2, torch.full_like(x2, V))
    obs = torch.bincount(x1 * (V + 1) + col, minlength=V * (V + 1))
    assert chisquare_p(obs, exp) > ALPHA


# -- negative controls: a biased verifier must fail the same tests ---------------------------

def eager_verify(*args, **kwargs) -> VerifyResult:
    """Accepts drafted children too often: uniforms halved (min(1, 2 p / q) acceptance)."""
    probs, offsets, tree, greedy, node_u, bonus_u = args
    return verify_tree(probs, offsets, tree, greedy, node_u * 0.5, bonus_u)


def test_negative_control_biased_acceptance_fails():
    assert run_stochastic_chains(eager_verify) < ALPHA
    rows = random_rows(4, seed=30)
    res = run(rows, [([5, 0, 3], [-1, -1, -1])] * COPIES, seed=31, verify=eager_verify)
    assert first_token_p(res, rows[0]) < ALPHA


def test_negative_control_skipped_residual_fails(monkeypatch):
    original = verifier._normalise

    def no_residual(r: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
        return original(r if fallback is None else fallback)

    monkeypatch.setattr(verifier, "_normalise", no_residual)
    assert run_stochastic_chains() < ALPHA
    rows = random_rows(4, seed=30)
    res = run(rows, [([5, 0, 3], [-1, -1, -1])] * COPIES, seed=31)
    assert first_token_p(res, rows[0]) < ALPHA
