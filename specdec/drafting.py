"""Drafting: the drafter instances, each request's depth, proposals, and what drafters learn.

One drafter instance per `Speculation.drafter_key` (method and what it is built from: a draft
model, an EAGLE head), shared by every request that names it. A request's speculation is
resolved and checked at admission (`resolve`): a bad option or a head that cannot be loaded is a
ValueError before the request reaches a step. Each step, `depths` chooses every speculating
decode's draft depth (its own k, or the controller's choice for adaptive requests, see
specdec/spec_control.py) and `propose` asks each drafter for its requests' trees in one batch.
After the target pass, drafters that consume target hidden states (EAGLE) get their rows
(`observe_prefills`, `observe_verified`), and every drafter hears what was accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from drafters import Drafter, DraftRequest, check_speculative, drafter_class
from drafters.base import AUTO_DRAFTERS
from drafters.tree import DraftTree, row_shape
from specdec.config import SpeculativeConfig
from specdec.cost_model import CostModel
from specdec.depth_plan import Alternative, Candidate
from specdec.outputs import SpecMetrics
from specdec.request import NO_SPECULATION, Request, Speculation
from specdec.scheduler import StepPlan
from specdec.spec_control import SpeculationController
from specdec.step_inputs import NO_DRAFT, Draft

log = logging.getLogger("specdec.engine")

# (method, source, options) -> a drafter: specdec.engine builds drafters for the target.
DrafterFactory = Callable[[str, "str | None", dict], Drafter]


class Drafting:
    def __init__(self, default: SpeculativeConfig, build: DrafterFactory,
                 adaptive_default: bool) -> None:
        self.default = default
        self._build = build
        self.adaptive_default = adaptive_default
        self.drafters: dict[tuple[str, str | None], Drafter] = {}
        self.controller = SpeculationController(CostModel())
        self.totals: dict[str, SpecMetrics] = {}  # per method, over every request
        # (request, drafter key) -> the request's length at that drafter's last proposal
        self._proposed: dict[tuple[str, tuple[str, str | None]], int] = {}
        # request -> the depth its drafter was last asked for, where the drafter may stop short
        # (Drafter.last_asked): its verification is judged at that depth
        self._asked: dict[str, int] = {}
        # request -> (speculation, depth, fallback) the last planned step gave it (`_hold`)
        self._planned: dict[str, tuple[Speculation, int, Any]] = {}

    # -- admission --------------------------------------------------------------------------
    def resolve(self, override: dict[str, Any] | None) -> Speculation:
        """A request's speculation: the engine's default, or its own dict, checked and with its
        drafter built (a draft model or EAGLE head loads here, once per source)."""
        if override is not None:
            check_speculative(override)  # at admission: a bad option never reaches a step
        sc = self.default if override is None else SpeculativeConfig.from_dict(override)
        if override is not None and sc.method == "draft_model" and not sc.draft_model:
            sc = replace(sc, draft_model=self.default.draft_model)
        if sc.method == "none" or sc.num_speculative_tokens == 0:
            return NO_SPECULATION
        if sc.method == "auto":
            return self._resolve_auto(sc)
        drafter_class(sc.method)  # unknown methods fail here, at admission
        opts = dict(sc.options)
        if sc.method == "draft_model":
            if not sc.draft_model:
                raise ValueError("speculative method 'draft_model' needs a draft_model")
            opts["draft_model"] = sc.draft_model
        if sc.method == "eagle" and "eagle_head" not in opts \
                and self.default.options.get("eagle_head"):
            opts["eagle_head"] = self.default.options["eagle_head"]
        spec = Speculation(sc.method, sc.num_speculative_tokens, opts,
                           bool(opts.get("adaptive", self.adaptive_default)))
        try:
            self.drafter(spec)  # built (a draft model or head loaded and checked) now
        except OSError as exc:
            what = "eagle_head" if spec.method == "eagle" else "draft_model"
            raise ValueError(f"speculative.{what}: cannot load {spec.source!r}: {exc}") from exc
        return spec

    def _resolve_auto(self, sc: SpeculativeConfig) -> Speculation:
        """`auto`: the n-gram lookup and, where a draft model is configured, the draft model,
        each with the options that are its own; the controller picks per sequence and step."""
        parts = []
        for method in AUTO_DRAFTERS:
            opts = {k: v for k, v in sc.options.items() if k in drafter_class(method).options}
            if method == "draft_model":
                source = sc.draft_model or self.default.draft_model
                if not source:
                    continue
                opts["draft_model"] = source
            parts.append(SpeculativeConfig(method, sc.num_speculative_tokens, opts.pop(
                "draft_model", None), opts))
        alts = tuple(self.resolve(p.to_dict()) for p in parts)
        alts = tuple(replace(a, adaptive=True) for a in alts if a.on)
        if not alts:
            return NO_SPECULATION
        return Speculation("auto", sc.num_speculative_tokens, dict(sc.options), True, alts)

    def drafter(self, spec: Speculation) -> Drafter:
        key = spec.drafter_key
        d = self.drafters.get(key)
        if d is None:
            options = dict(self.default.options)
            if spec.method == "eagle" and spec.source is not None:
                options["eagle_head"] = spec.source
            d = self.drafters[key] = self._build(spec.method, spec.source, options)
        return d

    def first_drafter(self, spec: Speculation) -> Drafter:
        """The drafter a request starts with (an `auto` request's first choice)."""
        return self.drafter(spec.alternatives[0] if spec.alternatives else spec)

    def load_default(self) -> None:
        """Build the engine-wide default drafter now, so that no request pays for it."""
        self.resolve(None)

    # -- a step -----------------------------------------------------------------------------
    def depths(self, decoding: list[Request]) -> None:
        """Set each decode's drafter and draft depth for this step: its own k, or the
        controller's choice for adaptive requests (an `auto` request's drafter too)."""
        if self._hold(decoding):
            return
        fixed: list[Request] = []
        cands: list[Candidate] = []
        for r in decoding:
            r.depth, r.active, r.fallback = 0, r.spec, None
            if not r.spec.on:
                continue
            if r.spec.adaptive:
                cands.append(Candidate(r.request_id, [self._alternative(r, s)
                                                      for s in self._choices(r)]))
            else:
                fixed.append(r)
                r.depth = r.spec.k
        plain = len(decoding) - len(fixed) - len(cands)
        base = len(decoding) + sum(self.max_nodes(r) for r in fixed)
        by_id = {r.request_id: r for r in decoding}
        base_q = 1 + max((self.max_nodes(r) for r in fixed), default=0)
        for rid, ch in self.controller.choose(base, plain, cands, len(decoding),
                                              base_q).items():
            r = by_id[rid]
            choices = self._choices(r)
            r.active, r.depth = choices[ch.alternative], ch.k
            r.drafter = self.drafter(r.active)
            if ch.fallback is not None and ch.k > 0:
                r.fallback = (choices[ch.fallback], ch.fallback_k)
        self._planned = {r.request_id: (r.active, r.depth, r.fallback) for r in decoding}

    def _hold(self, decoding: list[Request]) -> bool:
        """Give every decode the depth the last planned step gave it, without asking the
        controller, where it holds that choice (a runner that pads: one depth for the batch,
        held until the next probe) and the batch is that step's, less requests that finished:
        the host-built steps between probes then do what chained steps do on the device. The
        choice's host work (its candidates' estimates and the plan) sat between every two
        host-planned steps: about 2 ms at batch 128 on the 2-core CPU
        (bench/investigations/controller_host.py)."""
        ctl = self.controller
        if (not ctl.uniform or not ctl.holding or not decoding
                or any(r.request_id not in self._planned for r in decoding)
                or not any(r.spec.adaptive for r in decoding) or not ctl.hold_step()):
            return False
        for r in decoding:
            r.active, r.depth, r.fallback = self._planned[r.request_id]
            if r.spec.adaptive:
                r.drafter = self.drafter(r.active)
        return True

    def _alternative(self, r: Request, s: Speculation) -> Alternative:
        """What drafting `r` with `s` this step would gain (survival) and cost (tree width; a
        stale model drafter's catch-up)."""
        d = self.drafter(s)
        behind = 0 if d.proposes_by_lookup else d.catch_up_tokens(self._behind(r, s),
                                                                  s.options)
        catch_up = self.controller.costs.draft.catch_up_time(s.method, behind)
        stale = behind > 2
        survival = self.controller.survival(r.request_id, s.method, s.k,
                                            fade=not (stale and catch_up > 0))
        left = r.seq.params.max_tokens - len(r.seq.output_token_ids)
        reach = (self.controller.reach(r.request_id, s.method, s.k) if d.stops_short else None)
        return Alternative(s.method, s.k, d.max_nodes(1, s.options), survival,
                           d.proposes_by_lookup, stale, catch_up,
                           self.controller.start_cost(s.method, behind, left, survival), reach)

    def _behind(self, r: Request, spec: Speculation) -> int:
        """Tokens `spec`'s drafter has not seen of `r` (since its last proposal for it)."""
        return r.seq.num_tokens - self._proposed.get((r.request_id, spec.drafter_key), 0)

    @staticmethod
    def _choices(r: Request) -> tuple[Speculation, ...]:
        return r.spec.alternatives or (r.spec,)

    def max_nodes(self, r: Request) -> int:
        """The tree size `r` asks the scheduler for at its depth this step (its fallback's,
        if larger)."""
        spec = r.active or r.spec
        n = r.drafter.max_nodes(r.depth, spec.options) if r.depth else 0
        if r.fallback is not None:
            fb, k = r.fallback
            n = max(n, self.drafter(fb).max_nodes(k, fb.options))
        return n

    def propose(self, plan: StepPlan, requests: dict[str, Request]) -> list[Draft]:
        """Per decode in the plan, its draft tree (a drafter's requests in one batch); then,
        for `auto` requests whose lookup found nothing, their fallback drafter's. A batch
        whose drafter raises is proposed again one request at a time: a request whose own
        proposal raises fails alone (`Request.fail`) and decodes without a draft."""
        drafts = [NO_DRAFT] * len(plan.decodes)
        reqs = [requests[d.seq.request_id] for d in plan.decodes]
        self._propose_round(plan, reqs, drafts, [
            i for i, (d, r) in enumerate(zip(plan.decodes, reqs))
            if d.max_draft_nodes > 0 and r.spec.on and r.depth > 0])
        missed = [i for i, r in enumerate(reqs)
                  if r.fallback is not None and not drafts[i].tokens and not r.seq.aborted]
        for i in missed:
            r = reqs[i]
            (r.active, r.depth), r.fallback = r.fallback, None
            r.drafter = self.drafter(r.active)
        self._propose_round(plan, reqs, drafts, missed)
        return drafts

    def _propose_round(self, plan: StepPlan, reqs: list[Request], drafts: list[Draft],
                       which: list[int]) -> None:
        groups: dict[tuple[str, str | None], list[int]] = {}
        for i in which:
            groups.setdefault(reqs[i].active.drafter_key, []).append(i)
        for idxs in groups.values():
            t0 = time.perf_counter()
            group = [reqs[i] for i in idxs]
            batch = [DraftRequest(
                request_id=r.request_id, tokens=r.seq.tokens,
                max_nodes=plan.decodes[i].max_draft_nodes, k=r.depth,
                options=r.active.options, params=r.seq.params, generator=r.generator)
                for i, r in zip(idxs, group)]
            drafter, method = group[0].drafter, group[0].active.method
            try:
                tree: DraftTree = drafter.propose(batch)
            except Exception:
                log.exception("drafter %r failed on a batch of %d", method, len(batch))
                for i, r, b in zip(idxs, group, batch):
                    self._propose_alone(drafts, i, r, b, plan.decodes[i].max_draft_nodes)
                continue
            seconds = time.perf_counter() - t0
            self._fill(drafts, idxs, tree, [plan.decodes[i].max_draft_nodes for i in idxs])
            ran = max(b.k for b in batch)  # the depth its passes reached
            if drafter.last_asked is not None:  # as deep as its deepest chain
                ran = max((_depth(drafts[i].parents) for i in idxs), default=0)
            self.controller.record_draft(method, len(batch), ran, seconds,
                                         drafter.last_catch_up)
            asked = drafter.last_asked or [0] * len(group)
            for r, a in zip(group, asked):
                self._proposed[(r.request_id, r.active.drafter_key)] = r.seq.num_tokens
                self._asked[r.request_id] = a

    def _propose_alone(self, drafts: list[Draft], i: int, r: Request, b: DraftRequest,
                       max_nodes: int) -> None:
        """After its batch raised: r's own proposal (its drafter first forgets what the failed
        batch may have left half-done), or r fails."""
        self.release(r)
        try:
            tree = r.drafter.propose([b])
        except Exception as exc:
            log.exception("drafter %r failed for %s", r.active.method, r.request_id)
            r.fail(f"speculative drafter {r.active.method!r} failed: {exc}")
            self.release(r)
            return
        self._asked[r.request_id] = (r.drafter.last_asked or [0])[0]
        self._fill(drafts, [i], tree, [max_nodes])

    @staticmethod
    def _fill(drafts: list[Draft], idxs: list[int], tree: DraftTree,
              max_nodes: list[int]) -> None:
        """Cut a batch's tree into its requests' drafts, at most max_nodes[j] nodes each."""
        # Whole-batch host copies: one conversion each, not one per sequence.
        all_toks, all_pars = tree.host_lists()
        stoch = tree.stochastic.tolist() if tree.draft_probs is not None else None
        for j, i in enumerate(idxs):
            s, e = tree.offsets[j], tree.offsets[j + 1]
            m = max_nodes[j]
            probs = None
            if stoch is not None and e > s and all(stoch[s:e]):
                probs = tree.draft_probs[s:e][:m]
            drafts[i] = Draft(all_toks[s:e][:m], all_pars[s:e][:m], probs)

    def device_kind(self, r: Request) -> tuple | None:
        """How the device can draft for `r` (chained steps, specdec/chaining.py): ("table",),
        ("lookup", min_n, max_n), or None where only the host can."""
        if r.spec.alternatives:
            return None  # the drafter changes from step to step
        drafter, opts = r.drafter, r.spec.options
        if drafter.has_position_table(opts):
            return ("table",)
        if drafter.has_device_lookup(opts):
            return ("lookup", int(opts.get("min_n", 1)), int(opts.get("max_n", 3)))
        return None

    # -- target features (EAGLE) ------------------------------------------------------------
    def wants_features(self, r: Request) -> bool:
        return r.drafter is not None and r.drafter.needs_hidden_states

    def capture_layers(self, reqs: list[Request]) -> tuple[int, ...] | None:
        """Union of target layers the step's drafters need features from; None when no drafter
        in the step consumes target features."""
        layers: set[int] | None = None
        for r in reqs:
            if self.wants_features(r):
                layers = (layers or set()) | set(r.drafter.capture_layers)
        return None if layers is None else tuple(sorted(layers))

    def _features(self, r: Request, features: torch.Tensor, capture: tuple[int, ...],
                  rows: torch.Tensor) -> torch.Tensor:
        """The features r's drafter asked for, in its capture_layers order, at the given rows."""
        d = r.drafter
        hid = features.shape[1] // (len(capture) + 1)
        cols = [capture.index(layer) for layer in d.capture_layers] + [len(capture)]
        return torch.cat([features[rows, c * hid:(c + 1) * hid] for c in cols], dim=-1)

    def observe_chunk(self, r: Request, start: int, num: int, features: torch.Tensor,
                      capture: tuple[int, ...], first_row: int) -> None:
        """A prefill chunk's features: positions start .. start + num - 1."""
        rows = torch.arange(first_row, first_row + num, device=features.device)
        r.drafter.observe(r.request_id, start, r.seq.tokens[start:start + num],
                                     self._features(r, features, capture, rows))

    def observe_verified(self, r: Request, context: int, tokens: list[int],
                         features: torch.Tensor, capture: tuple[int, ...], root_row: int,
                         accepted: list[int]) -> None:
        """A verified decode's features: its root's row, then its accepted nodes'."""
        rows = torch.tensor([root_row] + [root_row + 1 + a for a in accepted],
                            device=features.device)
        r.drafter.observe(r.request_id, context, tokens,
                                     self._features(r, features, capture, rows))

    # -- after a step -----------------------------------------------------------------------
    def accepted(self, r: Request, kept: list[int]) -> None:
        if r.drafter is not None:
            r.drafter.accepted(r.request_id, r.seq.num_tokens, kept)

    def release(self, r: Request) -> None:
        """The request finished or was preempted: its drafters drop what they held for it."""
        if r.drafter is None:
            return
        self.controller.forget(r.request_id)
        self._asked.pop(r.request_id, None)
        self._planned.pop(r.request_id, None)
        for spec in self._choices(r):
            self._proposed.pop((r.request_id, spec.drafter_key), None)
            drafter = self.drafters.get(spec.drafter_key)
            if drafter is None:
                continue
            try:
                drafter.release(r.request_id)
            except Exception:  # a drafter that cannot forget a request must not fail a step
                log.exception("drafter %r could not release %s", spec.method, r.request_id)

    def record(self, r: Request, drafted: int, accepted: int, emitted: int, depth: int) -> None:
        method = (r.active or r.spec).method
        r.metrics.record(drafted, accepted, emitted, depth)
        tot = self.totals.get(method)
        if tot is None:
            tot = self.totals[method] = SpecMetrics(method=method)
        tot.record(drafted, accepted, emitted, depth)
        # A chain its drafter stopped short (a draft model's `p_min`) is judged at the depth it
        # was asked for: the positions it did not draft count as offered and rejected, since
        # its passes were paid all the same. Judged by its drafted tokens alone, a ShareGPT
        # prompt whose first draft was confident in 32 of 91 steps looked like 0.69 acceptance
        # at the first position where each asked step gave 0.24, and the CPU server drafted it
        # to 0.81-0.92x of plain (bench/results/HISTORY.md, 2026-12-07).
        offered = max(depth, self._asked.pop(r.request_id, 0))
        self.controller.verified(r.request_id, method, offered, accepted, emitted, depth,
                                 chosen=r.spec.adaptive)


def _depth(parents: list[int]) -> int:
    return row_shape(parents).depth if parents else 0
