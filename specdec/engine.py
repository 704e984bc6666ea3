"""The engine: its public API and `step()`, where one step reads top to bottom.

A step: finish aborted requests; if the step launched last time can be chained, launch the next
one from its verdict on the device (specdec/chaining.py), then commit it; else commit it (the
step's one host synchronisation, specdec/commit.py), choose draft depths and schedule
(specdec/drafting.py, specdec/scheduler.py), draft, build the inputs (specdec/step_inputs.py),
launch the pass and its verification (specdec/verdict.py); build the outputs
(specdec/output_builder.py). With overlap on, a launched step is committed by the next call,
after that call has launched its own pass or staged it: the host's bookkeeping and
detokenizing of step n run while step n + 1 computes.

Work done for one request that raises (its drafter's proposal, the commit of its row) fails that
request alone (`Request.fail`); a step that raises as a whole is pinned on its request by
specdec/isolation.py, through `run_only` and `fail_request`.
"""

from __future__ import annotations

import functools
import gc
import random
import time
from dataclasses import replace
from typing import Any

import torch

from drafters import create_drafter
from specdec.block_manager import BlockManager
from specdec.calibration import calibrate_runner
from specdec.chaining import Chainer
from specdec.commit import Launched, Row, Settled, StepCommitter
from specdec.config import (
    EngineConfig,
    RuntimeConfig,
    SpeculativeConfig,
    engine_config_from_args,
    resolve_model_config,
)
from specdec.cost_model import step_period
from specdec.detokenizer import IncrementalDetokenizer
from specdec.drafting import Drafting
from specdec.model_runner import ModelRunner
from specdec.output_builder import OutputBuilder
from specdec.outputs import RequestOutput, SpecMetrics
from specdec.request import Request, prompt_ids
from specdec.sampler import TokenPieces
from specdec.sampling_params import SamplingParams
from specdec.scheduler import Scheduler, StepPlan
from specdec.sequence import Sequence
from specdec.step_inputs import Draft, bucket, plan_segments
from specdec.stop_rules import TextRules
from specdec.verdict import verify_step


class LLMEngine:
    def __init__(self, config: EngineConfig, attention_backend: str = "auto",
                 adaptive_speculation: bool = False) -> None:
        """`adaptive_speculation`: requests that do not say otherwise (`"adaptive"` in their
        speculative dict) let the engine shrink their draft length, down to plain decoding,
        whenever measured costs say speculation would not pay (specdec.spec_control)."""
        from transformers import AutoTokenizer

        mc = resolve_model_config(config.model)
        self.config = config = replace(config, model=mc)
        self.tokenizer = AutoTokenizer.from_pretrained(mc.path)
        self.model_name = mc.model
        self.max_model_len = int(mc.max_model_len or 4096)
        self.runner = ModelRunner(mc, config.cache, attention_backend, config.runtime)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching, self.runner.resident_blocks)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._launched: Launched | None = None  # launched, not committed (see step)
        self._carried: list[RequestOutput] = []  # outputs of a step that raised
        self._returned = 0.0  # when the last step() returned (overlap: see step_period)
        self._planned = 0.0  # host seconds spent planning the step in flight (overlap: see step)
        self._rng = random.Random(config.seed)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids)))
        self.token_pieces = TokenPieces(self.tokenizer, self.eos_token_ids)  # infill sampler
        self.drafting = Drafting(config.speculative, self._build_drafter, adaptive_speculation)
        if self.runner.graphs is not None:  # one depth a step, priced by its graph bucket
            self.drafting.controller.pads_to(bucket)
        self.drafting.controller.costs.follows_pace = self.runner.device.type == "cpu"
        self.outputs = OutputBuilder(set(self.eos_token_ids))
        self.committer = StepCommitter(self.runner, self.blocks, self.scheduler, self.drafting,
                                       self.outputs, self.max_model_len)
        self.chainer = Chainer(self.runner, self.blocks, self.drafting, self.token_pieces,
                               self.max_model_len)
        self.use_runtime(config.runtime)
        # What exists now lives as long as the engine: kept out of the collector's full
        # passes, whose host stalls outlast a decode step (bench/gpu_decode_attn.py timeline).
        gc.collect()
        gc.freeze()

    @staticmethod
    def from_args(model: str, **kw: Any) -> LLMEngine:
        """Build from flat keyword arguments (the Python API and the CLI use this; sorted by
        specdec.config.engine_config_from_args)."""
        cfg, backend, adaptive = engine_config_from_args(model, **kw)
        return LLMEngine(cfg, attention_backend=backend, adaptive_speculation=adaptive)

    def use_runtime(self, runtime: RuntimeConfig) -> None:
        """Take `runtime`'s overlap switches; the rest of it is fixed when the runner is built.
        Between requests only: benchmarks compare overlap on and off on one engine (a GPU
        engine's graph capture and tuning take minutes)."""
        if self.has_unfinished() or self._launched is not None:
            raise RuntimeError("the runtime changes only while no request is in the engine")
        fixed = [f for f in ("cuda_graphs", "tune_graphs", "tune_context", "tuning_cache", "pdl",
                             "skinny_tune")
                 if getattr(runtime, f) != getattr(self.config.runtime, f)]
        if fixed:
            raise ValueError(f"{', '.join(fixed)} cannot change after the engine is built")
        self.config = replace(self.config, runtime=runtime)
        self.overlap = (self.runner.device.type == "cuda" if runtime.overlap is None
                        else runtime.overlap)
        self.chainer.plain = self.overlap
        self.chainer.speculative = self.overlap and runtime.spec_overlap is not False

    def _build_drafter(self, method: str, source: str | None, options: dict):
        return create_drafter(
            method, draft_model=source if method == "draft_model" else None,
            target=self.config.model, cache=self.config.cache,
            target_vocab=self.tokenizer.get_vocab(), target_model=self.runner.model,
            options=options, runtime=self.config.runtime)

    # -- requests ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def default_spec(self) -> SpeculativeConfig:
        return self.config.speculative

    @property
    def spec_totals(self) -> dict[str, SpecMetrics]:
        return self.drafting.totals

    @property
    def in_flight(self) -> Launched | None:
        """The step launched and not yet committed (overlap on), if any."""
        return self._launched

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> None:
        """Admit a request; every check that can fail runs here (ValueError), not in a step."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_ids(self.tokenizer, prompt, self.runner.vocab_size, self.max_model_len,
                         self.blocks.num_blocks * self.blocks.block_size)
        spec = self.drafting.resolve(params.speculative)
        seq = Sequence(request_id, ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.requests[request_id] = Request(
            seq, spec, torch.Generator().manual_seed(seed),
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                   params.stop, TextRules.of(params)),
            SpecMetrics(method=spec.method) if spec.on else None,
            self.drafting.first_drafter(spec) if spec.on else None)
        self.scheduler.add(seq)

    def load_default_drafter(self) -> None:
        """Build the engine-wide default drafter now (a draft model loads its weights), so that
        no request pays for it; the server calls this before it reports ready."""
        if self.default_spec.method != "none":
            self.drafting.load_default()
            from specdec.models.heap import release_freed_memory

            release_freed_memory()

    @property
    def plans_speculation(self) -> bool:
        """Whether requests that say nothing get the controller's depths (and drafters)."""
        return self.drafting.adaptive_default or self.default_spec.method == "auto"

    def calibrate_costs(self) -> dict[int, float]:
        """Measure the target pass by query rows, which the speculation controller plans with
        (specdec/cost_model.py), and each loaded draft model's, or load them from the cache of
        an earlier start on this machine; the server calls this before it reports ready."""
        if self.has_unfinished():
            return {}
        costs = self.drafting.controller.costs
        max_rows = self.config.scheduler.max_num_batched_tokens
        curve = calibrate_runner(self.runner, max_rows, costs.calibrate)
        runners = [self.runner]
        for drafter in list(self.drafting.drafters.values()):
            runner = getattr(drafter, "runner", None)
            if isinstance(runner, ModelRunner) and not drafter.proposes_by_lookup:
                calibrate_runner(runner, max_rows,
                                 functools.partial(costs.draft.calibrate, drafter.name))
                runners.append(runner)
        if self.blocks.num_used == 0 and not self.blocks.cached:
            # What the timed passes wrote across the pools holds nothing anyone reads (a draft
            # model's pool has no cache, and no request has started).
            for runner in runners:
                runner.release_kv_pages()
        return curve

    def warm_up(self) -> None:
        """One short generation (it compiles and chooses the CPU kernels, or captures the
        CUDA graphs), whose acceptance the speculation controller then forgets: drafting for a
        one-token prompt says nothing of real traffic, and one rejection there had the
        controller keep a draft model off for every request after it. The server calls this
        before it reports ready."""
        self.add_request("warm-up", [0], SamplingParams(max_tokens=4, temperature=0.0))
        while self.has_unfinished():
            self.step()
        self.drafting.controller.forget_evidence()
        self.drafting.totals.clear()

    def abort_request(self, request_id: str) -> None:
        r = self.requests.get(request_id)
        if r is not None:
            r.seq.aborted = True

    def fail_request(self, request_id: str, message: str) -> None:
        """End the request at the next step with finish reason "error" and `message`."""
        r = self.requests.get(request_id)
        if r is not None:
            r.fail(message)

    @property
    def request_ids(self) -> list[str]:
        """The requests in the engine, in arrival order."""
        return [rid for rid, r in self.requests.items() if not r.seq.is_finished]

    def run_only(self, request_ids: set[str] | None) -> None:
        """Let steps run only these requests (None: all): specdec/isolation.py finds the
        request that makes a step raise by running suspects apart."""
        self.scheduler.run_only(request_ids)

    def stats(self) -> dict[str, Any]:
        return {"kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
                "prefix_cache_queries": self.blocks.prefix_queries,
                "prefix_cache_hits": self.blocks.prefix_hits,
                "num_running": self.num_running, "num_waiting": self.num_waiting,
                "speculative": {m: s.to_dict() for m, s in self.spec_totals.items()},
                "speculation_control": {m: s.to_dict() for m, s in
                                        self.drafting.controller.stats.items()}}

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it moved on."""
        outputs, self._carried = self._carried, []
        settled: list[Settled] = []
        aborted: list[Request] = []
        t_step, t_draft = time.perf_counter(), 0.0
        planning = 0.0  # overlap: host seconds this call spent planning the step it launched
        done: Launched | None = None  # the step this call commits, which it times
        chained = False  # this call launched the next step from `done`'s verdict
        try:
            aborted = self._finish_aborted()
            launched, self._launched = self._launched, None
            if launched is not None and self.chainer.can_chain(launched, self.scheduler):
                # Step n + 1 staged on the device from step n's verdict, then n committed.
                nxt = self.chainer.chain(launched)
                settled = self.committer.commit(launched, in_flight=nxt.chain.shape.rows)
                self._launched = nxt.rebase()
                done, chained = launched, True
            else:
                if launched is not None:
                    settled = self._commit(launched)  # the step's one host synchronisation
                    done = launched
                t_plan = time.perf_counter()
                decoding = [self.requests[s.request_id] for s in self.scheduler.running
                            if not s.in_prefill]
                self.drafting.depths(decoding)
                plan = self.scheduler.schedule({r.request_id: n for r in decoding
                                                if (n := self.drafting.max_nodes(r))})
                for seq in plan.preempted:
                    self.drafting.release(self.requests[seq.request_id])
                if not plan.empty:
                    t = time.perf_counter()
                    drafts = self.drafting.propose(plan, self.requests)
                    t_draft = time.perf_counter() - t
                    launched = self._launch(plan, drafts)
                    if self.overlap:
                        self._launched = launched  # committed by the next call
                        planning = time.perf_counter() - t_plan - t_draft
                    elif launched is not None:
                        settled += self._commit(launched)
                        done = launched
        except Exception:
            # Drafters may be left half-updated (a proposal never told what was accepted):
            # they forget every request and catch up at its next proposal.
            for r in self.requests.values():
                self.drafting.release(r)
            raise
        finally:  # outputs of a step that raised are returned by the next call
            outputs += [self._output(*s) for s in settled]
            outputs += [self._output(r, [], None, True) for r in aborted]
            self._carried = outputs
        self._carried = []
        if done is not None and done.num_tokens and all(row.decode for row in done.rows) \
                and done.num_tokens == sum(1 + len(row.parents) for row in done.rows):
            # The controller plans with whole decode steps, host work and overlap as they are
            # (a chained step hides its host work), less the drafters' time, counted apart.
            # Prefill steps are left out: under overlap a lone prefill's call can return in a
            # fraction of its pass (256 rows read 0.66 ms on the H200, below a 1-row decode).
            seconds = time.perf_counter() - t_step - t_draft
            if self.overlap:
                # A step's planning (the device idle) is its cost, not the committed one's: a
                # plain step whose successor the host planned read 8.1 ms at batch 32 on an
                # H100, 6.7 chained, and n-gram drafted where plain paid (gpu_goodput_h100_
                # 20261207_s33_*: 0.86-0.98x of off at batch 32-128).
                seconds = step_period(seconds - planning + self._planned, t_step - self._returned)
            if seconds is not None:
                self.drafting.controller.record_pass(
                    done.num_tokens, seconds, sum(1 for row in done.rows if row.parents),
                    chained, len(done.rows), max(1 + len(row.parents) for row in done.rows))
        self._planned = planning
        self._returned = time.perf_counter()
        return outputs

    def _commit(self, launched: Launched) -> list[Settled]:
        return self.committer.commit(launched)

    def _finish_aborted(self) -> list[Request]:
        aborted = [r for r in self.requests.values() if r.seq.aborted and not r.seq.is_finished]
        for r in aborted:
            r.seq.finish_reason = "abort" if r.error is None else "error"
            self.scheduler.finish(r.seq)
            self.drafting.release(r)
        return aborted

    def _launch(self, plan: StepPlan, drafts: list[Draft]) -> Launched | None:
        """Run the plan's pass and queue its verification; None when no row samples."""
        done = [p.completes for p in plan.prefills]  # before the commits below move them on
        completing = [self.requests[p.seq.request_id] for p, d in zip(plan.prefills, done) if d]
        decodes = [self.requests[d.seq.request_id] for d in plan.decodes]
        capture = self.drafting.capture_layers(
            [self.requests[p.seq.request_id] for p in plan.prefills] + decodes)
        segs = plan_segments(plan, drafts, self.blocks, self.runner.vocab_size)
        chain = self.chainer.qualifies(plan, drafts, decodes, capture)
        launched_at = time.perf_counter()
        out = self.runner.execute(segs, capture)
        for i, p in enumerate(plan.prefills):
            r = self.requests[p.seq.request_id]
            if capture is not None and self.drafting.wants_features(r):
                self.drafting.observe_chunk(r, p.seq.num_computed, p.num_tokens, out.features,
                                            capture, out.query_offsets[i])
            if not done[i]:
                self.blocks.commit(p.seq, p.seq.num_computed + p.num_tokens)
        if chain is not None:
            return self.chainer.first(out, segs[len(plan.prefills):], decodes, *chain,
                                      launched_at)
        # Every sampling sequence is verified: a completed prefill or a plain decode is a root
        # with an empty tree. The logits of completed prefills come first, then decodes'.
        reqs = completing + decodes
        if not reqs:
            return None
        trees = [([], [])] * len(completing) + [(d.tokens, d.parents) for d in drafts]
        first = [out.row_offsets[i] for i, d in enumerate(done) if d]
        first += out.row_offsets[len(plan.prefills):]
        qoff = out.query_offsets or [0] * len(segs)  # known to eager passes (features)
        qrows = [qoff[i] for i, d in enumerate(done) if d] + qoff[len(plan.prefills):]
        verdict, logits, root_rows = verify_step(
            out.logits, first, reqs, trees, [None] * len(completing) + [d.probs for d in drafts],
            self.runner.vocab_size, self.token_pieces)
        rows = [Row(r, r.seq.num_computed, pars, i >= len(completing), q)
                for i, (r, (_, pars), q) in enumerate(zip(reqs, trees, qrows))]
        # The rows the pass ran: drafts may come smaller than the room the plan reserved.
        return Launched(rows, verdict, sum(len(s.tokens) for s in segs), launched_at, logits,
                        root_rows, out.features, capture)

    def _output(self, r: Request, new: list[int], logprobs, finished: bool) -> RequestOutput:
        if finished:
            self.requests.pop(r.request_id, None)
        return self.outputs.build(r, new, logprobs, finished)
