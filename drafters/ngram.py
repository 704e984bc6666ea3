"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

from typing import Any

from drafters.base import Drafter, DraftRequest, register
from drafters.tree import DraftTree


class _Index:
    """n-gram -> start positions, extended incrementally as a sequence grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.seen = 0
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def update(self, tokens: list[int]) -> None:
        # An n-gram is indexed once a token follows it, so a match always has a continuation.
        for end in range(max(self.seen, 1), len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self.starts.setdefault(tuple(tokens[end - n:end]), []).append(end - n)
        self.seen = max(self.seen, len(tokens))


@register
class NgramDrafter(Drafter):
    """Options: `min_n` (default 1), `max_n` (3), `branches` (2): how many differing
    continuations (most recent first) become sibling branches of the tree."""

    name = "ngram"

    def __init__(self, **_: Any) -> None:
        self._index: dict[str, _Index] = {}

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        return k * max(1, int(options.get("branches", 2)))

    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        return DraftTree.from_lists([self._one(r) for r in batch])

    def _one(self, r: DraftRequest) -> tuple[list[int], list[int]]:
        min_n = int(r.options.get("min_n", 1))
        max_n = int(r.options.get("max_n", 3))
        branches = max(1, int(r.options.get("branches", 2)))
        idx = self._index.get(r.request_id)
        if idx is None or idx.seen > len(r.tokens) or (idx.min_n, idx.max_n) != (min_n, max_n):
            idx = self._index[r.request_id] = _Index(min_n, max_n)
        idx.update(r.tokens)
        toks = r.tokens
        for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
            starts = idx.starts.get(tuple(toks[-n:]))
            if not starts:
                continue
            conts: list[list[int]] = []
            for s in reversed(starts):  # most recent occurrence first
                c = toks[s + n:s + n + r.k]
                if c and c not in conts:
                    conts.append(c)
                if len(conts) == branches:
                    break
            return _trie(conts, r.max_nodes)
        return [], []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def _trie(conts: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a tree (shared prefixes share nodes), best first."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for c in conts:
        parent = -1
        for t in c:
            key = (parent, t)
            if key not in child:
                if len(tokens) == max_nodes:
                    return tokens, parents
                child[key] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = child[key]
    return tokens, parents
