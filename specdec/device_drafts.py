"""Where a chained speculative step's drafts come from on the device (specdec/chaining.py).

Step n + 1 is launched before step n's verdict reaches the host, so its drafts must be made on
the device from what the device knows: each sequence's positions after step n, and the tokens
step n emitted. Two sources:

- `TableDrafts`: position tables (`Drafter.position_table`, the replay drafter); node i of a
  sequence takes the table's entry at its position and its column among its siblings.
- `LookupDrafts`: prompt lookup (the n-gram drafter with `on_device`); every sequence's tokens
  live in a device history that each step's emitted tokens extend, and `lookup` finds the
  latest earlier occurrence of the longest suffix there, as `drafters.ngram.lookup_chain` does
  on the host, token for token.

Both are made when a chain starts and moved on with it: `next(emitted, num, rows, ...)` is
queued behind step n (it may read step n's emitted tokens), `drafts(pos, shape)` inside the
staging fix of step n + 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.verdict import TreeShape


COLUMN_ROUND = 256  # lookups search the histories' first `bound` columns, rounded up to this


class TableDrafts:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [n, L, W] per sequence, per position, per sibling column

    def next(self, emitted: torch.Tensor, num: torch.Tensor, rows: torch.Tensor,
             same_rows: bool, bound: int) -> TableDrafts:
        """The tables of the sequences kept (`rows` of the step before)."""
        return self if same_rows else TableDrafts(self.table.index_select(0, rows))

    def drafts(self, pos: torch.Tensor, shape: TreeShape) -> torch.Tensor:
        """[n, N] node tokens, from the nodes' positions `pos` ([n, N])."""
        _, col, _, _ = shape.tensors(pos.device)
        n, _, width = self.table.shape
        return self.table.view(n, -1).gather(1, pos * width + col)


class LookupDrafts:
    def __init__(self, hist: torch.Tensor, length: torch.Tensor, min_n: int, max_n: int,
                 bound: int) -> None:
        self.hist = hist  # [n, C] int64: each sequence's tokens, its root last
        self.length = length  # [n] int64: tokens held per row
        self.min_n, self.max_n = min_n, max_n
        self.bound = bound  # the host's upper bound on `length`: the columns worth searching

    @staticmethod
    def from_tokens(tokens: list[list[int]], capacity: int, min_n: int, max_n: int,
                    device: torch.device) -> LookupDrafts:
        hist = torch.zeros(len(tokens), capacity, dtype=torch.long)
        for i, t in enumerate(tokens):
            hist[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        length = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        return LookupDrafts(hist.to(device), length.to(device), min_n, max_n,
                            max(map(len, tokens)))

    def next(self, emitted: torch.Tensor, num: torch.Tensor, rows: torch.Tensor,
             same_rows: bool, bound: int) -> LookupDrafts:
        """The kept sequences' histories with the step before's emitted tokens appended
        (`emitted` [n, k + 1], `num` [n] of them per row: its accepted drafts, then the bonus
        token, the next step's root); `bound`: the most tokens a kept sequence can now hold,
        as the host knows it."""
        hist = self.hist if same_rows else self.hist.index_select(0, rows)
        length = self.length if same_rows else self.length.index_select(0, rows)
        emitted = emitted.index_select(0, rows)  # [n, k + 1]
        num = num.index_select(0, rows)  # [n]
        j = torch.arange(emitted.shape[1], device=hist.device)
        # Columns past a row's count are written where the next step's tokens will go and
        # overwritten then; the capacity leaves room for them. In place: the step before's
        # history is not read again.
        hist.scatter_(1, length[:, None] + j, emitted)
        return LookupDrafts(hist, length + num, self.min_n, self.max_n, bound)

    def drafts(self, pos: torch.Tensor, shape: TreeShape) -> torch.Tensor:
        assert shape.is_chain, "prompt lookup drafts chains"
        # Only the columns a history can reach: the capacity is the model's whole context.
        cols = min(self.hist.shape[1], -(-self.bound // COLUMN_ROUND) * COLUMN_ROUND)
        return lookup(self.hist[:, :cols], self.length, self.min_n, self.max_n, shape.k)


def lookup(hist: torch.Tensor, length: torch.Tensor, min_n: int, max_n: int, k: int
           ) -> torch.Tensor:
    """[n, k] drafts per row of `hist` ([n, C], `length` tokens each): for the longest n in
    max_n .. min_n whose last-n-token suffix occurs earlier with a token after it, the latest
    such occurrence's continuation, repeated with the period it implies (the distance from
    that occurrence to the suffix) to fill k; the last token k times where nothing matches.
    `drafters.ngram.lookup_chain` is the host's, and the reference."""
    rows, cap = hist.shape
    dev = hist.device
    cols = torch.arange(cap, device=dev)
    best = torch.full((rows,), -1, dtype=torch.long, device=dev)  # start of the occurrence
    best_n = torch.zeros(rows, dtype=torch.long, device=dev)
    for n in range(max_n, max(1, min_n) - 1, -1):
        span = cap - n  # starts 0 .. cap - n - 1 leave a token after the n-gram
        if span <= 0:
            continue
        suffix = hist.gather(1, (length[:, None] - n + cols[:n]).clamp(min=0))  # [n_rows, n]
        match = hist[:, :span] == suffix[:, :1]
        for j in range(1, n):
            match &= hist[:, j:j + span] == suffix[:, j:j + 1]
        match &= cols[:span] <= (length - n - 1)[:, None]  # before the suffix, a token after
        start = torch.where(match, cols[:span], -1).amax(dim=1)
        take = (best < 0) & (start >= 0)
        best = torch.where(take, start, best)
        best_n = torch.where(take, n, best_n)
    period = (length - best_n - best).clamp(min=1)  # [n_rows]
    j = torch.arange(k, device=dev)
    src = torch.where((best >= 0)[:, None], (best + best_n)[:, None] + j % period[:, None],
                      (length - 1)[:, None])
    return hist.gather(1, src)
