"""`DraftTree`: the one data contract between drafters, the verifier and attention.

A tree hangs below each speculating sequence's *root*: the last token the sequence already has
(sampled last step, not yet in the KV cache). Nodes are flattened over a ragged batch; within a
sequence they are numbered 0..n-1 in topological order (a parent before its children, siblings in
the drafter's order of preference). A chain of k tokens is a tree whose node i has parent i-1.

In the verification pass a sequence contributes 1 + n query tokens: the root, then its nodes in
order. Node i sits at query row 1 + i, at KV slot `context_len + 1 + i`, at position
`context_len + depth[i]`, and attends to the paged prefix, the root and its own ancestors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] int64 node tokens
    parents: torch.Tensor  # [N] int64 local parent index, -1 = the root
    depths: torch.Tensor  # [N] int64 depth, 1 for the root's children
    offsets: tuple[int, ...]  # B+1 node offsets: sequence b owns nodes offsets[b]:offsets[b+1]
    # Optional draft distributions: row n is the distribution node n was sampled from (the
    # drafter's distribution at n's parent). Nodes with stochastic[n] False are deterministic
    # proposals (point masses) and their rows are unused.
    draft_probs: torch.Tensor | None = None  # [N, vocab] float32, on the drafters' device
    stochastic: torch.Tensor | None = None  # [N] bool
    # The (tokens, parents) host lists `from_lists` built the tensors from, kept for `host_lists`.
    host: tuple[list[int], list[int]] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_nodes(self) -> int:
        return self.offsets[-1]

    def sizes(self) -> list[int]:
        return [self.offsets[b + 1] - self.offsets[b] for b in range(self.num_seqs)]

    def seq(self, b: int) -> tuple[list[int], list[int]]:
        """Host lists (tokens, parents) of sequence b's nodes."""
        s, e = self.offsets[b], self.offsets[b + 1]
        return self.tokens[s:e].tolist(), self.parents[s:e].tolist()

    def host_lists(self) -> tuple[list[int], list[int]]:
        """Every node's (tokens, parents) as host lists, without a device copy when the tree was
        built from lists."""
        if self.host is not None:
            return self.host
        return self.tokens.tolist(), self.parents.tolist()

    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    def ancestor_mask(self, b: int) -> torch.Tensor:
        """[1 + n, 1 + n] bool: row r may attend column c (root is row/column 0)."""
        return ancestor_mask_of(self.seq(b)[1])

    @staticmethod
    def empty(num_seqs: int) -> DraftTree:
        z = torch.zeros(0, dtype=torch.long)
        return DraftTree(z, z, z, tuple([0] * (num_seqs + 1)))

    @staticmethod
    def from_lists(
        trees: Sequence[tuple[Sequence[int], Sequence[int]]],
        probs: Sequence[torch.Tensor | None] | None = None,
        vocab_size: int | None = None,
    ) -> DraftTree:
        """Build and validate a batch from per-sequence (tokens, parents) lists.

        probs[b], when given, is [n_b, vocab] with the distribution each node was drawn from;
        None for a sequence whose proposals are deterministic.
        """
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        offsets = [0]
        for toks, pars in trees:
            if len(toks) != len(pars):
                raise ValueError("a draft tree needs one parent per node")
            shape = tuple(pars)
            depths += _depths(shape)  # checks that parents come first
            if toks and (min(toks) < 0 or (vocab_size is not None and max(toks) >= vocab_size)):
                bad = next(t for t in toks if t < 0 or (vocab_size and t >= vocab_size))
                raise ValueError(f"draft token {bad} outside the vocabulary")
            if _shares_parents(shape):
                _check_unique_siblings(toks, pars)
            tokens += toks
            parents += pars
            offsets.append(len(tokens))
        draft_probs = stochastic = None
        if probs is not None and any(p is not None for p in probs):
            if vocab_size is None:
                raise ValueError("vocab_size is needed with draft probabilities")
            # Rows stay on the drafters' device (the verifier reads them there).
            dev = next(p.device for p in probs if p is not None)
            rows = []
            flags = []
            for (toks, _), p in zip(trees, probs):
                if p is None:
                    rows.append(torch.zeros(len(toks), vocab_size, device=dev))
                    flags += [False] * len(toks)
                else:
                    if p.shape != (len(toks), vocab_size):
                        raise ValueError(f"draft probs {tuple(p.shape)} != ({len(toks)}, "
                                         f"{vocab_size})")
                    rows.append(p.to(dev, torch.float32))
                    flags += [True] * len(toks)
            draft_probs = torch.cat(rows) if rows else torch.zeros(0, vocab_size, device=dev)
            stochastic = torch.tensor(flags, dtype=torch.bool)
        # One numpy conversion for the three lists: a third of torch.tensor's time per list (a
        # speculative step builds its batch's tree on the host while the device waits).
        arr = torch.from_numpy(np.array([tokens, parents, depths], dtype=np.int64))
        return DraftTree(arr[0], arr[1], arr[2], tuple(offsets), draft_probs, stochastic,
                         host=(tokens, parents))


class RowShape(NamedTuple):
    """A sequence's rows in a verification pass, from its tree's parent list alone."""

    offsets: tuple[int, ...]  # position of each row past the context: the root's 0, then depths
    mask: torch.Tensor | None  # the ancestor mask (ancestor_mask_of); None for a bare root
    logits_rows: tuple[int, ...]  # 0 .. n: every row's logits are verified
    depth: int  # the deepest node's depth (0 for a bare root)


def row_shape(parents: Sequence[int]) -> RowShape:
    """`RowShape` of a tree's parent list: one cached lookup per sequence and step, where the
    depths, mask and rows would take three (a speculative step builds these for every sequence
    while the device waits)."""
    return _row_shape(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _row_shape(parents: tuple[int, ...]) -> RowShape:
    depths = _depths(parents)
    return RowShape((0, *depths), _ancestor_mask(parents) if parents else None,
                    tuple(range(1 + len(parents))), max(depths, default=0))


@functools.lru_cache(maxsize=4096)
def _depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Depth of each node (1 for the root's children); parents must come before children."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come first")
        depths.append(1 if p < 0 else depths[p] + 1)
    return tuple(depths)


def ancestor_mask_of(parents: Sequence[int]) -> torch.Tensor:
    """[1 + n, 1 + n] bool ancestor mask of one sequence's tree from its host parent list.
    Drafters repeat a few tree shapes (a chain of k is always the same), so masks are cached by
    shape and shared: read them, never write them."""
    return _ancestor_mask(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    n = len(parents)
    rows = [[True] + [False] * n]  # the root sees only itself
    for i, p in enumerate(parents):
        row = list(rows[p + 1])  # a node sees what its parent sees (the root if p == -1) ...
        row[i + 1] = True  # ... and itself
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


@functools.lru_cache(maxsize=4096)
def _shares_parents(parents: tuple[int, ...]) -> bool:
    """Whether two nodes share a parent: only then can siblings repeat a token (not in a chain)."""
    return len(set(parents)) != len(parents)


def _check_unique_siblings(tokens: Sequence[int], parents: Sequence[int]) -> None:
    seen: set[tuple[int, int]] = set()
    for t, p in zip(tokens, parents):
        if (p, t) in seen:
            raise ValueError(f"token {t} proposed twice under parent {p}")
        seen.add((p, t))


def chain(tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a chain: each node's parent is the one before it."""
    return list(tokens), list(range(-1, len(tokens) - 1))
