"""A step's verdict: per row, the tokens it emits (accepted draft tokens, then the bonus token)
and which draft nodes were accepted, computed on the device and copied to the host behind it.

Every kind of step produces one `Verdict`; a plain decode (or a completed prefill) is the
zero-node case: one emitted token, no accepted nodes. Nothing here waits for the device; the
one host synchronisation of a step is `Verdict.read`.

- `verify_step`: a step as the host built it (ragged trees, any sampling): the tree verifier
  (verify_kernels/reference.py; on CUDA one launch, verify_kernels.acceptance), or, for a step
  greedy throughout, each row's argmax, which `read` walks on the host (verify_greedy_lists).
- `accept_greedy`: greedy trees of one shape (`TreeShape`) for every row, on the device: what a
  chained step needs (specdec/chaining.py), whose rows' tokens the host does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafters.tree import DraftTree
from specdec.request import Request
from specdec.sampler import (
    HostCopy,
    RowContext,
    TokenPieces,
    argmax_rows,
    device_to_host,
    greedy_tokens,
    host_to_device,
    process_logits,
    row_contexts,
)
from specdec.sampling_params import SamplingParams
from verify_kernels.reference import verify_greedy_lists, verify_tree


@dataclass
class Verdict:
    rows: int
    host: HostCopy  # emitted [n * width] | counts [n] | accepted nodes [n * (width - 1)]
    width: int  # emitted-token columns per row: the deepest tree's depth + 1
    emitted: torch.Tensor | None = None  # [n, width] on the device (chained steps read it)
    num: torch.Tensor | None = None  # [n] tokens emitted per row (device); None: one each
    # An all-greedy host step: `host` holds every query row's argmax, walked on the host over
    # these (draft tokens, parents) per row and each row's root in the argmax.
    walk: tuple[list[tuple[list[int], list[int]]], list[int]] | None = None

    @staticmethod
    def of(emitted: torch.Tensor, num: torch.Tensor, nodes: torch.Tensor) -> Verdict:
        """From device tensors: emitted [n, w], counts [n], accepted nodes [n, w - 1]."""
        n, w = emitted.shape
        packed = torch.cat([emitted.flatten(), num.to(emitted.dtype), nodes.flatten()])
        return Verdict(n, device_to_host(packed), w, emitted, num)

    @staticmethod
    def plain(tokens: torch.Tensor) -> Verdict:
        """Plain decodes, one token per row ([n] on the device): the zero-node case."""
        return Verdict(len(tokens), device_to_host(tokens), 1, tokens[:, None])

    def read(self) -> tuple[list[list[int]], list[list[int]]]:
        """Per row (emitted tokens, accepted local nodes): the step's host synchronisation."""
        flat = self.host.tolist()
        if self.walk is not None:
            return verify_greedy_lists(flat, *self.walk)
        if self.num is None:  # plain decodes
            return [[t] for t in flat], [[] for _ in flat]
        n, w = self.rows, self.width
        num = flat[n * w:n * w + n]
        acc = flat[n * w + n:]
        return ([flat[b * w:b * w + num[b]] for b in range(n)],
                [acc[b * (w - 1):b * (w - 1) + num[b] - 1] for b in range(n)])


def verify_step(
    logits: torch.Tensor,  # [L, V] raw: the pass's logits rows
    first_rows: list[int],  # per row, its root's row in `logits`, its nodes' rows after it
    reqs: list[Request],  # per row: completed prefills, then decodes
    trees: list[tuple[list[int], list[int]]],  # per row, (draft tokens, parents)
    probs: list[torch.Tensor | None],  # per row, its drafts' distributions (None: greedy)
    vocab: int,
    pieces: TokenPieces,
) -> tuple[Verdict, torch.Tensor, list[int]]:
    """Queue a host-built step's verification behind its pass, and its copy to the host.
    Returns (verdict, the verdict's logits rows, each row's root among them)."""
    rows: list[int] = []  # each root then its nodes (usually every logits row, in order)
    root_rows: list[int] = []
    rows_params: list[SamplingParams] = []
    for off, r, (toks, _) in zip(first_rows, reqs, trees):
        root_rows.append(len(rows))
        rows += range(off, off + 1 + len(toks))
        rows_params += [r.seq.params] * (1 + len(toks))
    if rows != list(range(logits.shape[0])):
        logits = logits[host_to_device(rows, torch.long, logits.device)]
    rows_ctx = None
    if any(r.seq.params.has_penalties for r in reqs):
        rows_ctx = row_contexts([], [(r.seq, t, p) for r, (t, p) in zip(reqs, trees)])
    if all(r.seq.params.greedy for r in reqs):
        # The host walks the trees over each row's argmax (verify_greedy_lists).
        am = greedy_tokens(logits, rows_params, rows_ctx)  # [R]
        return Verdict(len(reqs), device_to_host(am), 0, walk=(trees, root_rows)), logits, \
            root_rows
    # A step that samples anywhere verifies the batch as one DraftTree.
    tree = (DraftTree.from_lists(trees, probs, vocab) if any(t for t, _ in trees)
            else DraftTree.empty(len(trees)))
    res = accept_on_device(logits, rows_params, rows_ctx, reqs, tree, root_rows, pieces)
    return Verdict.of(res.tokens, res.num_tokens, res.accepted_nodes), logits, root_rows


def accept_on_device(
    logits: torch.Tensor,  # [R, V] raw
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,
    reqs: list[Request],
    tree: DraftTree,
    root_rows: list[int],  # per request, its root's row
    pieces: TokenPieces,
):
    """The tree verifier's result (see verify_kernels/reference.py) for a step's rows, left on the
    device. Uniforms come from each request's own generator: one per node, then the bonus's."""
    dev = logits.device
    probs = process_logits(logits, rows_params, rows_ctx, pieces)
    sizes = tree.sizes()
    us = [torch.zeros(n + 1) if r.seq.params.greedy
          else torch.rand(n + 1, generator=r.generator) for r, n in zip(reqs, sizes)]
    u = torch.cat(us)  # [R]
    if tree.num_nodes:
        bonus_at = [o + n for o, n in zip(root_rows, sizes)]
        is_node = torch.ones(len(u), dtype=torch.bool)
        is_node[bonus_at] = False
        node_u, bonus_u = u[is_node], u[~is_node]
    else:
        node_u, bonus_u = u[:0], u
    greedy = host_to_device([r.seq.params.greedy for r in reqs], torch.bool, dev)
    verify = verify_tree
    if dev.type == "cuda":
        from verify_kernels.acceptance import accept_tree as verify  # one launch for the batch
    return verify(probs, host_to_device(root_rows, torch.long, dev), tree, greedy,
                  node_u.to(dev, non_blocking=True), bonus_u.to(dev, non_blocking=True))


class TreeShape:
    """The one draft-tree shape every row of a chained step has (specdec/chaining.py): which
    row is each node's parent, the nodes of each depth, and each node's rank among its siblings
    (its column in the position tables). No nodes: plain decoding."""

    def __init__(self, parents: list[int]) -> None:
        self.parents = list(parents)
        n = len(parents)
        self.depth: list[int] = []
        self.column: list[int] = []
        seen: dict[int, int] = {}
        for p in parents:
            self.depth.append(1 if p < 0 else self.depth[p] + 1)
            self.column.append(seen.get(p, 0))
            seen[p] = self.column[-1] + 1
        self.k = max(self.depth, default=0)
        self.rows = n + 1
        self.width = max(self.column, default=0) + 1
        self.is_chain = parents == list(range(-1, n - 1))
        self.levels = [[i for i in range(n) if self.depth[i] == d] for d in range(1, self.k + 1)]
        self._dev: dict[torch.device, tuple] = {}

    def tensors(self, device: torch.device):
        """(parent row per node [N], column per node [N], per depth its nodes and their parent
        nodes, rows 0 .. m - 1) on `device`."""
        t = self._dev.get(device)
        if t is None:
            prow = torch.tensor([1 + p for p in self.parents], dtype=torch.long)
            col = torch.tensor(self.column, dtype=torch.long)
            levels = [(torch.tensor(lv, dtype=torch.long),
                       torch.tensor([self.parents[i] for i in lv], dtype=torch.long))
                      for lv in self.levels]
            t = self._dev[device] = (
                prow.to(device), col.to(device),
                [(a.to(device), b.to(device)) for a, b in levels],
                torch.arange(self.rows, device=device))
        return t


def accept_greedy(logits: torch.Tensor, ids: torch.Tensor, shape: TreeShape
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a batch of same-shaped trees on the device. `logits` [n * m, V],
    each row's root then its nodes; `ids` [n, m] the rows' input tokens. A node is accepted
    when its token is the argmax of its parent's row and its parent is accepted (siblings hold
    distinct tokens, so at most one per depth is). Returns (emitted [n, k + 1], count [n],
    accepted node per depth [n, k], -1 past the path): the first `count` emitted tokens are the
    accepted path's then the bonus token. The host's rule is verify_greedy_lists."""
    n, m = ids.shape
    am = argmax_rows(logits).view(n, m)
    prow, _, levels, _ = shape.tensors(ids.device)
    acc = ids[:, 1:] == am.index_select(1, prow)  # [n, N]: matches its parent's argmax
    if shape.is_chain:
        acc = acc.to(torch.int32).cumprod(dim=1).bool()
    else:
        for nodes, pars in levels[1:]:
            acc[:, nodes] &= acc[:, pars]
    nodes = torch.stack([(acc[:, lv].long() * (lv + 1)).sum(dim=1) - 1 for lv, _ in levels],
                        dim=1)  # [n, k]
    count = (nodes >= 0).sum(dim=1) + 1
    path = torch.cat([torch.zeros_like(count)[:, None], 1 + nodes.clamp(min=0)], dim=1)
    return am.gather(1, path), count, nodes
