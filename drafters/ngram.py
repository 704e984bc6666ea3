"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix.

With `on_device` (chains only), every proposal is a chain of exactly k tokens
(`lookup_chain`), the same function of a sequence's tokens that `specdec.device_drafts.lookup`
computes on the device: steps can then be drafted there and launched before the step before is
read back (specdec/chaining.py). The continuation is repeated with the period the match
implies where it is shorter than k, and the last token fills the chain where nothing matches,
so the target verifies k + 1 rows every step, matched or not: worth it where lookups hit often
(code editing, quoting), not on open-ended chat."""

from __future__ import annotations

from typing import Any

from drafters.base import Drafter, DraftRequest, Option, register
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


def lookup_chain(tokens: list[int], index: _Index, k: int) -> list[int]:
    """k draft tokens (`on_device`): for the longest suffix n-gram with an earlier occurrence,
    what followed its latest one, repeated with period len(tokens) - n - start; else the last
    token k times."""
    for n in range(min(index.max_n, len(tokens) - 1), max(1, index.min_n) - 1, -1):
        starts = index.starts.get(tuple(tokens[-n:]))
        if starts:
            s = starts[-1]
            period = len(tokens) - n - s
            return [tokens[s + n + j % period] for j in range(k)]
    return tokens[-1:] * k


@register
class NgramDrafter(Drafter):
    """Options: `min_n` (default 1), `max_n` (3), `branches` (2): how many differing
    continuations (most recent first) become sibling branches of the tree; `on_device`
    (False): chains of k tokens always, drafted on the device in overlapped steps."""

    name = "ngram"
    proposes_by_lookup = True
    options = {"min_n": Option(int, 1, 16), "max_n": Option(int, 1, 16),
               "branches": Option(int, 1, 8), "on_device": Option(bool)}

    def __init__(self, **_: Any) -> None:
        self._index: dict[str, _Index] = {}

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        return k * (1 if options.get("on_device") else max(1, int(options.get("branches", 2))))

    def has_device_lookup(self, options: dict[str, Any]) -> bool:
        return bool(options.get("on_device"))

    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        self.last_catch_up = 1
        return DraftTree.from_lists([self._one(r) for r in batch])

    def _one(self, r: DraftRequest) -> tuple[list[int], list[int]]:
        min_n = int(r.options.get("min_n", 1))
        max_n = int(r.options.get("max_n", 3))
        branches = max(1, int(r.options.get("branches", 2)))
        idx = self._index.get(r.request_id)
        if idx is None or idx.seen > len(r.tokens) or (idx.min_n, idx.max_n) != (min_n, max_n):
            idx = self._index[r.request_id] = _Index(min_n, max_n)
            # A new index reads the whole context: not what a proposal usually costs.
            self.last_catch_up = max(self.last_catch_up, len(r.tokens))
        idx.update(r.tokens)
        toks = r.tokens
        if r.options.get("on_device"):
            chain = lookup_chain(toks, idx, min(r.k, r.max_nodes))
            return chain, list(range(-1, len(chain) - 1))
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
