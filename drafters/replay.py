"""Replay: proposes the target's own future tokens, corrupted at a set rate (for benchmarks).

A plain run records what the target generates for each prompt (`record`); the replay drafter
then proposes those tokens, replacing each by a different token with probability
`corrupt_rate`. Under greedy verification a replaced token is always rejected, so the rate alone
sets the acceptance: a chain of k proposals accepts on average sum_{i=1..k} (1 - r)^i tokens,
tau = 1 + that (`expected_tau`). The drafter itself costs almost nothing, so a benchmark built on
it measures the engine's verification cost, not a drafter's quality. Where no script applies
(none recorded, or the history left it), every proposal is a random token: the tree keeps its
shape and is rejected, which is how a recording run with `corrupt_rate` 1 verifies trees of
the same shape as the runs it is replayed into.

Options: `corrupt_rate` r (default 0), `branches` b (default 1: a chain). With b > 1 every depth
gets b - 1 sibling leaves beside the chain node; when the chain node is corrupted, each sibling
in turn carries the true token with probability 1 - r (a second guess, as tree drafters make).
`script`: {request_id: the request's whole expected token sequence, prompt then output}
overrides the recorded registry; `seed` (default 0). `survival` ("S1,S2,...", instead of
`corrupt_rate`): a measured acceptance profile, S_j = P(at least j accepted | drafted j deep),
replayed per draft depth (depth d is corrupted with probability 1 - S_d / S_(d-1), the last
ratio repeating past the profile); host proposals only. A chain replaying a profile draws the
fate of each output position's n-th proposal from a fixed hash of (the recorded prompt, the
position, n) (`_common_draw`): runs of one prompt that draft alike get the same acceptance,
whatever their request ids, so two configurations compare on the same luck (a benchmark cell
of one 256-token request at batch 1 otherwise moved its tau by up to 8% from run to run).

Proposals also come as a position table (`position_table`), for steps drafted on the device
(specdec/chaining.py): each position's level (the chain token, then its siblings) is drawn
once, in advance, as a step would draw it. The acceptance is the same in distribution: where
the script is missed, the target's own token replaces the guess and the next step starts past
that position, so each position is judged once, whether its draw was made in advance or at the
step.
"""

from __future__ import annotations

import functools
import random
import zlib
from typing import Any

import torch

from drafters.base import Drafter, DraftRequest, Option, register
from drafters.tree import DraftTree

# prompt token ids -> the target's generated token ids after it
_RECORDED: dict[tuple[int, ...], list[int]] = {}
_LENGTHS: set[int] = set()  # the recorded prompts' lengths, longest first in `_cursor`


def record(prompt: list[int], output: list[int]) -> None:
    """Register the target's output for `prompt` (what a plain greedy run generated)."""
    _RECORDED[tuple(int(t) for t in prompt)] = [int(t) for t in output]
    _LENGTHS.add(len(prompt))


def clear_recorded() -> None:
    _RECORDED.clear()
    _LENGTHS.clear()


def expected_tau(corrupt_rate: float, k: int) -> float:
    """Mean tokens per verification step of a replayed chain of k under greedy decoding."""
    p = 1.0 - corrupt_rate
    return 1.0 + sum(p ** i for i in range(1, k + 1))


def rate_for_tau(tau: float, k: int) -> float:
    """The corrupt rate whose chain of k gives `tau` (bisection; tau must be in [1, k + 1])."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau {tau} is out of reach of a chain of {k}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tau(mid, k) > tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@functools.lru_cache(maxsize=64)
def depth_rates(survival: str) -> tuple[float, ...]:
    """"S1,S2,..." -> the corrupt rate at each draft depth that replays that profile (kept:
    parsed for every request at every step, it was a fifth of a proposal's host time at batch
    128: bench/investigations/host_phases.py)."""
    try:
        s = [float(x) for x in survival.split(",")]
    except ValueError:
        raise ValueError("speculative.survival must be comma-separated numbers") from None
    if not s or any(not 0.0 <= x <= 1.0 for x in s) or any(b > a for a, b in zip(s, s[1:])):
        raise ValueError("speculative.survival must be non-increasing numbers in [0, 1]")
    prev, rates = 1.0, []
    for x in s:
        rates.append(1.0 - (x / prev if prev > 0 else 0.0))
        prev = x
    return tuple(rates)


_M64 = (1 << 64) - 1


def _common_draw(key: int, position: int, n: int) -> float:
    """A uniform in [0, 1) fixed by (key, position, n): splitmix64's finaliser of their mix
    (0.5 us in Python, against 0.03 for `random.random`: 0.13 ms a step at batch 128, 2 deep)."""
    z = (key * 0xD1B54A32D192ED03 + (position * 64 + n + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


class _Cursor:
    """Where a request stands in its script."""

    def __init__(self, prompt_len: int, future: list[int] | None, seed: int,
                 prompt: tuple[int, ...] = ()) -> None:
        self.prompt_len = prompt_len
        self.future = future
        self.rng = random.Random(seed)
        # `_common_draw`'s key: the recorded prompt where there is one, else the seed
        self.key = seed if future is None or not prompt else zlib.crc32(str(prompt).encode())
        self.tries: dict[int, int] = {}  # output position -> proposals made for it
        self.checked = 0  # generated tokens already found to follow the script
        self.off = False  # the history has left the script (for good: tokens only grow)


@register
class ReplayDrafter(Drafter):
    name = "replay"
    options = {"branches": Option(int, 1, 8), "corrupt_rate": Option(float, 0.0, 1.0),
               "seed": Option(int, 0, 2**63 - 1), "script": Option(dict),
               "survival": Option(str)}

    @classmethod
    def check_options(cls, spec: dict[str, Any]) -> None:
        if "survival" in spec:
            depth_rates(spec["survival"])

    def __init__(self, target_vocab: dict[str, int] | None = None, target_model: Any = None,
                 **_: Any) -> None:
        # Random guesses stay inside both the tokenizer's ids and the model's embedding rows: a
        # tokenizer may hold ids past the model's vocabulary (the Qwen2.5 shape's benchmark
        # tokenizer has one), and such a draft would index past the embedding.
        sizes = [max(target_vocab.values()) + 1] if target_vocab else []
        embed = getattr(getattr(target_model, "model", None), "embed_tokens", None)
        if embed is not None:
            sizes.append(int(embed.num_embeddings))
        self._vocab = min(sizes) if sizes else None
        self._cursors: dict[str, _Cursor] = {}
        self._tables: dict[str, torch.Tensor] = {}  # per request: its position table

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        return k * max(1, int(options.get("branches", 1)))

    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        # A request's first proposal finds its script by its prompt (`_cursor`): 50-90 us a
        # request on an H100's host, against 12-20 for a usual one (64 first proposals
        # took 3.4-5.6 ms, bench/results/gpu_goodput_h100_20261207_s32_c_trace.jsonl).
        self.last_catch_up = max([1] + [len(r.tokens) for r in batch
                                        if r.request_id not in self._cursors])
        return DraftTree.from_lists([self._one(r) for r in batch])

    def release(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)
        self._tables.pop(request_id, None)

    def has_position_table(self, options: dict[str, Any]) -> bool:
        return "survival" not in options  # a profile is per depth, a table per position

    def position_table(self, r: DraftRequest, length: int, device: torch.device) -> torch.Tensor:
        """[length, branches]: the chain token then its siblings at each position, drawn as
        `_one` draws a level, once per position."""
        t = self._tables.get(r.request_id)
        if t is not None and t.shape[0] == length and t.device == device:
            return t
        cur = self._cursor(r)
        future = cur.future or []
        branches = max(1, int(r.options.get("branches", 1)))
        rate = float(r.options.get("corrupt_rate", 0.0))
        vocab = self._vocab or 2 + max(future, default=0) + branches
        g = torch.Generator().manual_seed(cur.rng.getrandbits(63))
        truth = torch.randint(0, vocab, (length,), generator=g)
        on = torch.zeros(length, dtype=torch.bool)  # positions the script covers
        n = max(0, min(len(future), length - cur.prompt_len))
        if n:
            truth[cur.prompt_len:cur.prompt_len + n] = torch.tensor(future[:n], dtype=torch.long)
            on[cur.prompt_len:cur.prompt_len + n] = True
        # Wrong guesses: distinct offsets from the truth, so siblings differ from it and from
        # each other.
        base = torch.randint(0, max(1, vocab - 1), (length, 1), generator=g)
        step = torch.arange(branches)[None, :]
        table = (truth[:, None] + 1 + (base + step) % max(1, vocab - 1)) % vocab
        placed = on & (torch.rand(length, generator=g) >= rate)
        table[:, 0] = torch.where(placed, truth, table[:, 0])
        for b in range(1, branches):  # a sibling carries the truth the chain node missed
            put = on & ~placed & (torch.rand(length, generator=g) >= rate)
            table[:, b] = torch.where(put, truth, table[:, b])
            placed |= put
        t = self._tables[r.request_id] = table.to(device)
        return t

    def _cursor(self, r: DraftRequest) -> _Cursor:
        cur = self._cursors.get(r.request_id)
        if cur is not None:
            return cur
        seed = zlib.crc32(f"{int(r.options.get('seed', 0))}:{r.request_id}".encode())
        script = r.options.get("script") or {}
        if r.request_id in script:
            cur = _Cursor(0, list(script[r.request_id]), seed)
        else:
            # The longest recorded prompt the request starts with, looked up by length: a
            # scan over every recorded prompt made a request's first proposal the slowest
            # (at batch 128 on an H100, 11-22 ms for 64 requests' first drafts against 1.4 ms
            # for a usual proposal), and the controller priced drafting by it.
            key = next((k for k in (tuple(r.tokens[:n]) for n in sorted(_LENGTHS, reverse=True)
                                    if n <= len(r.tokens)) if k in _RECORDED), None)
            cur = (_Cursor(0, None, seed) if key is None
                   else _Cursor(len(key), _RECORDED[key], seed, key))
        self._cursors[r.request_id] = cur
        return cur

    def _one(self, r: DraftRequest) -> tuple[list[int], list[int]]:
        cur = self._cursor(r)
        rng = cur.rng
        truth: list[int] = []
        if cur.future is not None:
            done = len(r.tokens) - cur.prompt_len
            if not cur.off:  # only the tokens added since the last step need checking
                new = r.tokens[cur.prompt_len + cur.checked:]
                cur.off = new != cur.future[cur.checked:done]
                cur.checked = done
            if not cur.off:
                truth = cur.future[done:done + r.k]
        rate = float(r.options.get("corrupt_rate", 0.0))
        profile = r.options.get("survival")
        rates = depth_rates(profile) if profile else (rate,)
        branches = max(1, int(r.options.get("branches", 1)))
        rand, other = rng.random, self._other
        if branches == 1:  # a chain: the loop below, one node a level (the same draws)
            nt = len(truth)
            tokens = []
            at = len(r.tokens) - cur.prompt_len
            for d in range(min(r.k, r.max_nodes)):
                t = truth[d] if d < nt else None
                rate = rates[min(d, len(rates) - 1)]
                if t is None:
                    bad = True
                elif profile:
                    n = cur.tries.get(at + d, 0)
                    cur.tries[at + d] = n + 1
                    bad = _common_draw(cur.key, at + d, n) < rate
                else:
                    bad = rand() < rate
                tokens.append(other(t, rng, ()) if bad else t)
            return tokens, list(range(-1, len(tokens) - 1))
        tokens: list[int] = []
        parents: list[int] = []
        chain_parent = -1
        for d in range(r.k):
            if len(tokens) >= r.max_nodes:
                break
            # Past the script (or off it) every guess is a random token: the tree keeps its
            # shape, so a step costs the same whether or not the script still applies.
            t = truth[d] if d < len(truth) else None
            rate = rates[min(d, len(rates) - 1)]
            bad = t is None or rand() < rate
            level = [other(t, rng, ()) if bad else t]
            placed = not bad
            for _ in range(branches - 1):
                if not placed and t is not None and rand() >= rate:
                    level.append(t)
                    placed = True
                else:
                    level.append(other(t, rng, level))
            level = level[:r.max_nodes - len(tokens)]
            here = len(tokens)
            tokens += level
            parents += [chain_parent] * len(level)
            chain_parent = here
        return tokens, parents

    def _other(self, t: int | None, rng: random.Random, avoid) -> int:
        """A token other than `t` and the tokens in `avoid` (siblings must differ)."""
        vocab = self._vocab or 2 + max([t or 0, *avoid]) + len(avoid)
        while True:
            x = int(rng.random() * vocab)  # randrange's cost, without its checks
            if x != t and x not in avoid:
                return x
