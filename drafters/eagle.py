"""EAGLE drafting: a one-layer head over the target's own features, with dynamic trees.

The target hands over features of committed positions after each pass it already ran
(`observe`): no extra target forward. Head position p takes (feature of p, embedding of token
p + 1) and predicts the feature of p + 1, whose logits rank the token at p + 2. Each request
keeps a contiguous KV of its committed head positions; draft-only entries live for one
`propose` and are dropped.

Trees (EAGLE-2): the root's top_k children start the tree; at each further depth the top_k
frontier nodes by cumulative log-probability are expanded into top_k children each; finally the
best `max_nodes` nodes of everything grown are kept (a child never outscores its parent, so the
kept set is a tree). top_k 1 is a chain; with sampling a chain draws each token from the head's
distribution under the request's own transforms and reports it, while trees are deterministic
proposals (point masses), which keeps the verifier exact either way.

Options: num_speculative_tokens (depth), `top_k` (default 4), `max_nodes` (default 16),
`eagle_head` (directory; default: the head shipped for the target preset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drafters.base import Drafter, DraftRequest, Option, register
from drafters.eagle_head import EagleHead, load_head
from drafters.tree import DraftTree
from specdec.config import ModelConfig
from specdec.models.quant_linear import QuantLinear
from specdec.sampler import process_logits

HEADS_DIR = Path(__file__).resolve().parent.parent / "specdec" / "heads"
DEFAULT_TOP_K = 4
# The most positions of a sequence the head reads when it starts on one: its first proposal runs
# the head over every position it holds, a prefill of the head (bench/investigations/
# eagle_head_step.py times it), so a long prompt is read from its last CONTEXT positions, as a
# draft model does (drafters/draft_model.py DRAFT_CONTEXT).
CONTEXT = 256
DEFAULT_MAX_NODES = 16


def default_head_for(model: str) -> Path | None:
    """The head shipped in specdec/heads/ for a preset target, if any."""
    d = HEADS_DIR / Path(model).name
    return d if (d / "config.json").is_file() else None


@dataclass
class _State:
    base: int = 0  # first position of the contiguous run of observed features
    feats: list[torch.Tensor] = field(default_factory=list)  # fused [n, H] chunks from base
    num_feats: int = 0
    k: torch.Tensor | None = None  # [n_kv, Hkv, D] head KV of positions base .. base + n_kv - 1
    v: torch.Tensor | None = None

    @property
    def n_kv(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def features(self) -> torch.Tensor:
        if len(self.feats) > 1:
            self.feats = [torch.cat(self.feats)]
        return self.feats[0]


@register
class EagleDrafter(Drafter):
    name = "eagle"
    options = {"top_k": Option(int, 1, 16), "max_nodes": Option(int, 1, 128),
               "eagle_head": Option(str)}
    needs_hidden_states = True

    def __init__(self, target: ModelConfig, target_model: torch.nn.Module,
                 options: dict[str, Any] | None = None, **_: Any) -> None:
        options = options or {}
        path = options.get("eagle_head") or default_head_for(target.model)
        if path is None:
            raise ValueError(f"no EAGLE head is shipped for {target.model!r}: pass "
                             "speculative={'method': 'eagle', 'eagle_head': DIR}")
        p = next(target_model.parameters())
        hf = target_model.hf
        # A target whose weights stay quantized runs an int8 head on the same kernels.
        quantized = any(isinstance(m, QuantLinear) for m in target_model.modules())
        self.head: EagleHead = load_head(path, int(hf["hidden_size"]), p.dtype, p.device,
                                         int8_kernels=quantized)
        self.dtype = p.dtype
        self.embed = target_model.model.embed_tokens
        self.lm_head = target_model.lm_head
        self.vocab_size = int(hf["vocab_size"])
        self.capture_layers = self.head.capture_layers(int(hf["num_hidden_layers"]))
        self.default_top_k = int(options.get("top_k", DEFAULT_TOP_K))
        self.default_max_nodes = int(options.get("max_nodes", DEFAULT_MAX_NODES))
        self._states: dict[str, _State] = {}

    # -- settings -----------------------------------------------------------------------------
    def _top_k(self, options: dict[str, Any]) -> int:
        return max(1, int(options.get("top_k", self.default_top_k)))

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        top_k = self._top_k(options)
        if top_k == 1:
            return k
        return min(int(options.get("max_nodes", self.default_max_nodes)), k * top_k)

    # -- target features ----------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, request_id: str, start: int, tokens: list[int],
                features: torch.Tensor) -> None:
        s = self._states.setdefault(request_id, _State(base=start))
        end = s.base + s.num_feats
        if start > end or start < s.base:
            # A gap (a prefix-cache hit skipped positions) or a rewrite: start a new run.
            self._states[request_id] = s = _State(base=start)
        elif start < end:  # positions already held are final: keep the run up to `start`
            s.feats = [s.features()[:start - s.base]]
            s.num_feats = start - s.base
            if s.n_kv > s.num_feats:
                s.k, s.v = s.k[:s.num_feats], s.v[:s.num_feats]
        over = s.num_feats + features.shape[0] - CONTEXT
        if s.n_kv == 0 and over > 0:  # not drafted yet: keep the last CONTEXT positions
            old = min(over, s.num_feats)
            if old:
                s.feats = [s.features()[old:]] if old < s.num_feats else []
                s.num_feats -= old
            features = features[over - old:]
            s.base += over
        fused = self.head.fuse(features.to(self.dtype))  # [n, H]
        s.feats.append(fused)
        s.num_feats += fused.shape[0]

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # -- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        trees: list[tuple[list[int], list[int]]] = []
        probs: list[torch.Tensor | None] = []
        for r in batch:
            toks, pars, pr = self._propose_one(r)
            trees.append((toks, pars))
            probs.append(pr)
        return DraftTree.from_lists(trees, probs, self.vocab_size)

    def _catch_up(self, s: _State, tokens: list[int]) -> torch.Tensor | None:
        """Extend the head KV to the position before the root; the root's predicted feature
        [1, H], or None without features up to there."""
        root = len(tokens) - 1
        if s.base + s.num_feats < root or root - 1 < s.base:
            return None
        feats = s.features()
        lo, hi = s.base + s.n_kv, root  # head positions lo .. hi - 1 to compute
        if lo >= hi:  # nothing new (cannot happen once a step has run; kept safe)
            lo = hi - 1
            s.k, s.v = s.k[:lo - s.base], s.v[:lo - s.base]
        dev = feats.device
        pos = torch.arange(lo, hi, device=dev)
        emb = self.embed(torch.tensor(tokens[lo + 1:hi + 1], device=dev))  # [n, H]
        past = None if s.k is None or s.n_kv == 0 else (s.k, s.v)
        n_past = s.n_kv
        mask = torch.ones(hi - lo, n_past + hi - lo, dtype=torch.bool, device=dev)
        mask[:, n_past:] = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=dev).tril()
        h, k, v = self.head.step(feats[lo - s.base:hi - s.base], emb, pos, past, mask)
        s.k = k if past is None else torch.cat([s.k, k])
        s.v = v if past is None else torch.cat([s.v, v])
        return h[-1:]

    def _propose_one(self, r: DraftRequest) -> tuple[list[int], list[int], torch.Tensor | None]:
        s = self._states.get(r.request_id)
        depth = min(r.k, r.max_nodes)
        if s is None or depth <= 0:
            return [], [], None
        h_root = self._catch_up(s, r.tokens)
        if h_root is None:
            return [], [], None
        top_k = self._top_k(r.options)
        budget = min(r.max_nodes, self.max_nodes(r.k, r.options))
        if top_k == 1:
            return self._chain(s, r, h_root, min(depth, budget))
        return self._tree(s, r, h_root, depth, top_k, budget)

    def _expand(self, s: _State, h_par: torch.Tensor, toks: list[int], pos: list[int],
                anc: list[list[int]], tree_k: list[torch.Tensor], tree_v: list[torch.Tensor]
                ) -> torch.Tensor:
        """Run the head on draft nodes: inputs (parent's predicted feature, node's token) at
        `pos`; row i attends the committed KV and the draft entries `anc[i]` (its ancestors)
        plus itself. Appends the new entries to tree_k/tree_v; returns h [n, H]."""
        dev = h_par.device
        n, n_tree = len(toks), sum(t.shape[0] for t in tree_k)
        past_k = torch.cat([s.k] + tree_k)  # [S, Hkv, D]
        past_v = torch.cat([s.v] + tree_v)
        mask = torch.zeros(n, past_k.shape[0] + n, dtype=torch.bool, device=dev)
        mask[:, :s.n_kv] = True
        for i, a in enumerate(anc):
            mask[i, [s.n_kv + j for j in a]] = True
            mask[i, s.n_kv + n_tree + i] = True
        emb = self.embed(torch.tensor(toks, device=dev))  # [n, H]
        h, k, v = self.head.step(h_par, emb, torch.tensor(pos, device=dev), (past_k, past_v),
                                 mask)
        tree_k.append(k)
        tree_v.append(v)
        return h

    def _chain(self, s: _State, r: DraftRequest, h: torch.Tensor, depth: int):
        root_pos = len(r.tokens) - 1
        sample = not r.params.greedy
        toks: list[int] = []
        rows: list[torch.Tensor] = []
        tree_k: list[torch.Tensor] = []
        tree_v: list[torch.Tensor] = []
        for d in range(depth):
            if sample:
                q = process_logits(self.head.logits(h, self.lm_head), [r.params])[0]  # [V]
                tok = int(torch.multinomial(q.float().cpu(), 1, generator=r.generator))
                rows.append(q.float().cpu())
            else:
                tok = int(self.head.greedy(h, self.lm_head)[0])
            toks.append(tok)
            if d + 1 < depth:
                h = self._expand(s, h, [tok], [root_pos + d], [list(range(d))], tree_k, tree_v)
        return toks, list(range(-1, len(toks) - 1)), torch.stack(rows) if sample else None

    def _tree(self, s: _State, r: DraftRequest, h_root: torch.Tensor, depth: int, top_k: int,
              budget: int):
        root_pos = len(r.tokens) - 1
        # Grown nodes: token, parent (grown index), cumulative log-prob, depth, draft-KV row.
        tok: list[int] = []
        par: list[int] = []
        score: list[float] = []
        dep: list[int] = []
        kv_row: dict[int, int] = {}
        tree_k: list[torch.Tensor] = []
        tree_v: list[torch.Tensor] = []
        frontier = [-1]
        h = h_root  # [len(frontier), H]
        for d in range(1, depth + 1):
            logp = torch.log_softmax(self.head.logits(h, self.lm_head), -1)  # [F, V]
            base = torch.tensor([0.0 if f < 0 else score[f] for f in frontier])
            top = logp.topk(top_k, dim=-1)
            cand = (base[:, None] + top.values.cpu()).flatten()  # [F * top_k]
            first = len(tok)
            for fi, f in enumerate(frontier):
                for t in top.indices[fi].tolist():
                    tok.append(t)
                    par.append(f)
                    dep.append(d)
            score += cand.tolist()
            if d == depth:
                break
            best = cand.topk(min(top_k, cand.numel())).indices.tolist()
            frontier = [first + b for b in best]
            anc = [[kv_row[a] for a in _ancestors(par, n)] for n in frontier]
            for i, n in enumerate(frontier):
                kv_row[n] = sum(t.shape[0] for t in tree_k) + i
            h_par = h[[b // top_k for b in best]]  # [F, H]
            h = self._expand(s, h_par, [tok[n] for n in frontier],
                             [root_pos + d - 1] * len(frontier), anc, tree_k, tree_v)
        keep = sorted(range(len(tok)), key=lambda n: (-score[n], dep[n]))[:budget]
        order = sorted(keep, key=lambda n: (dep[n], keep.index(n)))
        local = {n: i for i, n in enumerate(order)}
        return [tok[n] for n in order], [local[par[n]] if par[n] >= 0 else -1
                                         for n in order], None


def _ancestors(parents: list[int], node: int) -> list[int]:
    """Grown indices of the strict ancestors of `node`, root side first."""
    out = []
    p = parents[node]
    while p >= 0:
        out.append(p)
        p = parents[p]
    return out[::-1]
