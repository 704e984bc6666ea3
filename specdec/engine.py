"""The engine step loop: schedule, draft, one target pass, verify, commit, report."""

from __future__ import annotations

import gc
import random
import time
from dataclasses import replace
from typing import Any

import torch

from drafters import DraftRequest, DraftTree, check_speculative, create_drafter, drafter_class
from drafters.tree import row_shape
from specdec.block_manager import BlockManager
from specdec.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_model_config,
)
from specdec.detokenizer import IncrementalDetokenizer
from specdec.model_runner import ModelRunner, Segment
from specdec.outputs import RequestOutput, SpecMetrics
from specdec.overlap import DecodePipeline
from specdec.sampler import TokenPieces, row_contexts
from specdec.sampling_params import SamplingParams
from specdec.scheduler import Scheduler, StepPlan
from specdec.sequence import Sequence
from specdec.spec_control import Candidate, SpeculationController, prior_for
from specdec.spec_overlap import SpecPipeline
from specdec.step_results import (
    PendingStep,
    Settled,
    finish_step,
    launch_verification,
    report,
)
from specdec.stop_rules import TextRules
from specdec.target_features import capture_layers, observe_prefills

# The CPU's per-step token budget: a step of that many prefill tokens takes 1-3 s there.
CPU_STEP_TOKENS = 256


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
        self.model_name = config.model.model
        self.max_model_len = int(mc.max_model_len or 4096)
        self.runner = ModelRunner(mc, config.cache, attention_backend)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len)
        self.default_spec = config.speculative
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._gens: dict[str, torch.Generator] = {}
        self._spec: dict[str, SpecMetrics] = {}
        self._drafters: dict[tuple[str, str | None], Any] = {}
        self._sent: dict[str, int] = {}
        self._rng = random.Random(config.seed)
        self.spec_totals: dict[str, SpecMetrics] = {}
        self._eos = set(mc.eos_token_ids)
        self.token_pieces = TokenPieces(self.tokenizer, sorted(self._eos))  # infill sampler
        self.adaptive_default = adaptive_speculation
        self.spec_control = SpeculationController()
        self._depth: dict[str, int] = {}  # this step's chosen draft depth per request
        self._pending: PendingStep | None = None  # launched, not read back (see step)
        self._carried: list[RequestOutput] = []  # outputs of a step that raised
        overlap = config.scheduler.overlap
        self.pipeline = DecodePipeline(self.runner.device.type == "cuda" if overlap is None
                                       else overlap)
        self.spec_pipeline = SpecPipeline(self.pipeline.enabled
                                          and config.scheduler.spec_overlap is not False)
        # What exists now lives as long as the engine: kept out of the collector's full
        # passes, whose host stalls outlast a decode step (bench/gpu_decode_attn.py timeline).
        gc.collect()
        gc.freeze()

    @staticmethod
    def from_args(model: str, dtype: str = "float32", device: str = "cpu",
                  speculative: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
        """Build from flat keyword arguments (the Python API and the CLI use this)."""
        mc_kw = {k: kw.pop(k) for k in ("load_format", "max_model_len", "quantization",
                                        "cpu_kernel") if k in kw}
        cc_kw = {k: kw.pop(k) for k in ("block_size", "num_blocks", "cpu_kv_bytes",
                                        "gpu_memory_utilization", "enable_prefix_caching")
                 if k in kw}
        sc_kw = {k: kw.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_waiting",
                                        "overlap", "spec_overlap") if k in kw}
        if device == "cpu" and sc_kw.get("max_num_batched_tokens") is None:
            # A CPU step computes about 100-200 tokens a second: a 2048-token step would hold
            # every other request for 10-20 s (bench/head_of_line.py).
            sc_kw["max_num_batched_tokens"] = CPU_STEP_TOKENS
        backend = kw.pop("attention_backend", "auto")
        adaptive = bool(kw.pop("adaptive_speculation", False))
        seed = kw.pop("seed", 0)
        if kw:
            raise TypeError(f"unknown engine arguments: {sorted(kw)}")
        if speculative is None:
            from specdec.hub import default_draft_for

            draft = default_draft_for(model)
            speculative = ({"method": "draft_model", "draft_model": draft} if draft
                           else {"method": "ngram"})
        cfg = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, **mc_kw),
            cache=CacheConfig(**cc_kw), scheduler=SchedulerConfig(**sc_kw),
            speculative=SpeculativeConfig.from_dict(speculative), seed=seed)
        return LLMEngine(cfg, attention_backend=backend, adaptive_speculation=adaptive)

    # -- requests ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._eos))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = (self.tokenizer.encode(prompt, add_special_tokens=False)
               if isinstance(prompt, str) else [int(t) for t in prompt])
        vocab = self.runner.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including the completion")
        max_blocks = self.blocks.num_blocks * self.blocks.block_size
        if len(ids) + 1 > max_blocks:
            raise ValueError(f"the prompt needs more KV cache ({len(ids)} tokens) than the "
                             f"engine has ({max_blocks} tokens)")
        spec = self._resolve_spec(params.speculative)
        seq = Sequence(request_id, ids, params)
        seq.spec_method, seq.spec_k, seq.spec_options = spec
        self.seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.skip_special_tokens, params.stop, TextRules.of(params))
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self._gens[request_id] = torch.Generator().manual_seed(seed)
        if seq.spec_method != "none":
            self._spec[request_id] = SpecMetrics(method=seq.spec_method)
        self.scheduler.add(seq)

    def _resolve_spec(self, override: dict[str, Any] | None) -> tuple[str, int, dict]:
        if override is not None:
            check_speculative(override)  # at admission: a bad option never reaches a step
        sc = self.default_spec if override is None else SpeculativeConfig.from_dict(override)
        if override is not None and sc.method == "draft_model" and not sc.draft_model:
            sc = replace(sc, draft_model=self.default_spec.draft_model)
        if sc.method == "none" or sc.num_speculative_tokens == 0:
            return "none", 0, {}
        drafter_class(sc.method)  # unknown methods fail here, at admission
        opts = dict(sc.options)
        if sc.method == "draft_model":
            if not sc.draft_model:
                raise ValueError("speculative method 'draft_model' needs a draft_model")
            opts["draft_model"] = sc.draft_model
        if sc.method == "eagle" and "eagle_head" not in opts \
                and self.default_spec.options.get("eagle_head"):
            opts["eagle_head"] = self.default_spec.options["eagle_head"]
        if sc.method in ("draft_model", "eagle"):
            self._drafter(sc.method, _source(sc.method, opts))  # load (and check) it now
        return sc.method, sc.num_speculative_tokens, opts

    def _drafter(self, method: str, source: str | None):
        """The drafter of `method` built from `source` (its draft model or EAGLE head; None:
        the default), one per such pair, shared by every request that names it."""
        key = (method, source)
        if key not in self._drafters:
            options = dict(self.default_spec.options)
            if method == "eagle" and source is not None:
                options["eagle_head"] = source
            self._drafters[key] = create_drafter(
                method, draft_model=source if method == "draft_model" else None,
                target=self.config.model, cache=self.config.cache,
                target_vocab=self.tokenizer.get_vocab(), target_model=self.runner.model,
                options=options)
        return self._drafters[key]

    def load_default_drafter(self) -> None:
        """Build the engine-wide default drafter now (a draft model loads its weights), so that
        no request pays for it; the server calls this before it reports ready."""
        spec = self.default_spec
        if spec.method != "none":
            self._drafter(spec.method, _source(spec.method, spec.to_dict()))
            from specdec.models.loader import release_freed_memory

            release_freed_memory()

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.aborted = True

    def stats(self) -> dict[str, Any]:
        return {"kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
                "prefix_cache_queries": self.blocks.prefix_queries,
                "prefix_cache_hits": self.blocks.prefix_hits,
                "num_running": self.num_running, "num_waiting": self.num_waiting,
                "speculative": {m: s.to_dict() for m, s in self.spec_totals.items()}}

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. With overlap on, a step's pass is left running on the device and
        read back by the next call, after that call has launched its own pass: the host's
        bookkeeping of step n (then its detokenizing) runs while step n + 1 computes."""
        outputs, self._carried = self._carried, []
        # specdec/overlap.py (plain decodes), specdec/spec_overlap.py (speculative steps)
        for pipe in (self.pipeline, self.spec_pipeline):
            if pipe.in_flight is not None:
                if pipe.can_chain(self):
                    return outputs + pipe.chain(self)
                outputs += pipe.drain(self)
        settled = self._read_back()
        aborted: list[Sequence] = []
        try:
            aborted = [s for s in self.seqs.values() if s.aborted and not s.is_finished]
            for seq in aborted:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                self._release_drafter(seq)
            self._depth = self._choose_depths()
            want = {rid: self._drafter_of(self.seqs[rid]).max_nodes(
                k, self.seqs[rid].spec_options) for rid, k in self._depth.items() if k > 0}
            plan = self.scheduler.schedule(want)
            for seq in plan.preempted:
                self._release_drafter(seq)
            if not plan.empty:
                self._pending = self._run(plan, self._propose(plan))
                if not self.pipeline.enabled:
                    settled += self._read_back()
        finally:  # outputs of a step that raised are returned by the next call
            outputs += report(self, settled)
            outputs += [self._output(seq, [], None, finished=True) for seq in aborted]
            self._carried = outputs
        self._carried = []
        return outputs

    def _read_back(self) -> list[Settled]:
        """Finish the launched step, if any (specdec/step_results.py)."""
        p, self._pending = self._pending, None
        if p is None:
            return []
        settled = finish_step(self, p)
        # Launch to read-back: the pass, or more when the host is the slower side.
        self.spec_control.record_pass(p.plan.num_tokens, time.perf_counter() - p.launched)
        return settled

    def _choose_depths(self) -> dict[str, int]:
        """Draft depth per speculating decode: its own k, or the controller's choice."""
        decoding = [s for s in self.scheduler.running if not s.in_prefill]
        fixed: dict[str, int] = {}
        cands: list[Candidate] = []
        for s in decoding:
            if s.spec_method == "none":
                continue
            if s.spec_options.get("adaptive", self.adaptive_default):
                cands.append(Candidate(
                    s.request_id, s.spec_method, s.spec_k, self._spec.get(s.request_id),
                    self._drafter_of(s).max_nodes(1, s.spec_options),
                    prior_for(self.spec_totals.get(s.spec_method))))
            else:
                fixed[s.request_id] = s.spec_k
        plain = len(decoding) - len(fixed) - len(cands)
        base = len(decoding) + sum(self._drafter_of(self.seqs[r]).max_nodes(
            k, self.seqs[r].spec_options) for r, k in fixed.items())
        return {**fixed, **self.spec_control.choose(base, plain, cands)}

    def _drafter_of(self, seq: Sequence):
        return self._drafter(seq.spec_method, _source(seq.spec_method, seq.spec_options))

    def _release_drafter(self, seq: Sequence) -> None:
        if seq.spec_method != "none":
            self._drafter_of(seq).release(seq.request_id)

    def _propose(self, plan: StepPlan) -> list[tuple[list[int], list[int], Any]]:
        """Per decode in the plan: (tokens, parents, probs or None) of its draft tree."""
        trees: list[tuple[list[int], list[int], Any]] = [([], [], None)] * len(plan.decodes)
        groups: dict[tuple[str, str | None], list[int]] = {}
        for i, d in enumerate(plan.decodes):
            if d.max_draft_nodes > 0 and d.seq.spec_method != "none":
                key = (d.seq.spec_method, _source(d.seq.spec_method, d.seq.spec_options))
                groups.setdefault(key, []).append(i)
        for key, idxs in groups.items():
            t0 = time.perf_counter()
            batch = [DraftRequest(
                request_id=plan.decodes[i].seq.request_id, tokens=plan.decodes[i].seq.tokens,
                max_nodes=plan.decodes[i].max_draft_nodes,
                k=self._depth.get(plan.decodes[i].seq.request_id, plan.decodes[i].seq.spec_k),
                options=plan.decodes[i].seq.spec_options, params=plan.decodes[i].seq.params,
                generator=self._gens[plan.decodes[i].seq.request_id]) for i in idxs]
            tree: DraftTree = self._drafter(*key).propose(batch)
            drafter = self._drafter(*key)
            self.spec_control.record_draft(key[0], max(r.k for r in batch),
                                           time.perf_counter() - t0,
                                           drafter.last_catch_up)
            # Whole-batch host copies: one conversion each, not one per sequence.
            all_toks, all_pars = tree.host_lists()
            stoch = tree.stochastic.tolist() if tree.draft_probs is not None else None
            for j, i in enumerate(idxs):
                s, e = tree.offsets[j], tree.offsets[j + 1]
                m = plan.decodes[i].max_draft_nodes
                probs = None
                if stoch is not None and e > s and all(stoch[s:e]):
                    probs = tree.draft_probs[s:e][:m]
                trees[i] = (all_toks[s:e][:m], all_pars[s:e][:m], probs)
        return trees

    def _run(self, plan: StepPlan, trees) -> PendingStep | None:
        bm = self.blocks
        segs: list[Segment] = []
        for p in plan.prefills:
            s, n = p.seq, p.num_tokens
            c = s.num_computed
            segs.append(Segment(s.tokens[c:c + n], list(range(c, c + n)), bm.slots(s, c, n), c,
                                list(s.block_table),
                                logits_rows=(n - 1,) if p.completes else ()))
        # Every sampling sequence goes through verification: a completed prefill or a plain
        # decode is a root with an empty tree. A step that samples anywhere verifies the batch
        # as one DraftTree, built (and validated) once; an all-greedy step walks the host lists.
        completing = [p for p in plan.prefills if p.completes]
        tree_lists = [([], [])] * len(completing) + [(toks, pars) for toks, pars, _ in trees]
        tree = None
        if not all(s.params.greedy for s in [p.seq for p in completing] + [
                d.seq for d in plan.decodes]):
            tree = (DraftTree.from_lists(tree_lists, [None] * len(completing) + [
                probs for _, _, probs in trees], self.runner.vocab_size)
                if any(toks for toks, _, _ in trees) else DraftTree.empty(len(tree_lists)))
        vocab = self.runner.vocab_size
        for d, (toks, pars, _) in zip(plan.decodes, trees):
            s, c, n = d.seq, d.seq.num_computed, len(toks)
            if toks and not 0 <= min(toks) <= max(toks) < vocab:
                raise ValueError(f"a draft token of {s.request_id} is outside the vocabulary")
            shape = row_shape(pars)
            segs.append(Segment([s.last_token] + toks, [c + x for x in shape.offsets],
                                bm.slots(s, c, 1 + n), c, s.block_table, mask=shape.mask,
                                logits_rows=shape.logits_rows))
        capture = capture_layers(self, plan)
        if self.spec_pipeline.enabled and self.spec_pipeline.qualifies(self, plan, trees,
                                                                       capture):
            self.spec_pipeline.launch(self, plan, segs, trees[0][1])
            return None  # read back by the next step
        if self.pipeline.enabled and self.pipeline.qualifies(plan, trees, capture):
            self.pipeline.launch(self, [d.seq for d in plan.decodes], segs)
            return None  # read back by the next step
        launched = time.perf_counter()
        out = self.runner.execute(segs, capture)
        if capture is not None:
            observe_prefills(self, plan, out, capture)

        samplers: list[tuple[Sequence, int]] = []  # (seq, context length before the step)
        rows_params: list[SamplingParams] = []
        row_offsets: list[int] = []
        for i, p in enumerate(plan.prefills):
            if p.completes:
                row_offsets.append(out.row_offsets[i])
                samplers.append((p.seq, p.seq.num_computed))
                rows_params.append(p.seq.params)
        for j, (d, (toks, _, _)) in enumerate(zip(plan.decodes, trees)):
            row_offsets.append(out.row_offsets[len(plan.prefills) + j])
            samplers.append((d.seq, d.seq.num_computed))
            rows_params += [d.seq.params] * (1 + len(toks))
        rows_ctx = None
        if any(s.params.has_penalties for s, _ in samplers):
            rows_ctx = row_contexts([p.seq for p in completing], [
                (d.seq, toks, pars) for d, (toks, pars, _) in zip(plan.decodes, trees)])
        for p in plan.prefills:
            if not p.completes:
                bm.commit(p.seq, p.seq.num_computed + p.num_tokens)
        if not samplers:
            return None
        return launch_verification(self, out, samplers, tree_lists, tree, rows_params, rows_ctx,
                                   row_offsets, plan, launched)

    def _output(self, seq: Sequence, new_ids: list[int], logprobs, finished: bool
                ) -> RequestOutput:
        detok = self._detok[seq.request_id]
        delta = detok.add(new_ids, final=finished)
        out = RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=detok.text, delta_token_ids=new_ids,
            delta_text=delta, finished=finished, finish_reason=seq.finish_reason,
            logprobs=logprobs, spec=self._spec.get(seq.request_id),
            num_cached_tokens=seq.num_cached_prompt_tokens, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, stop_reason=seq.stop_reason)
        if finished:
            self.seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
            self._gens.pop(seq.request_id, None)
            self._spec.pop(seq.request_id, None)
        return out


def _source(method: str, options: dict[str, Any]) -> str | None:
    """What a drafter of `method` is built from, as a request's options name it: the draft
    model, or the EAGLE head (a request's own head is honoured, not the first one built)."""
    if method == "draft_model":
        return options.get("draft_model")
    if method == "eagle":
        return options.get("eagle_head")
    return None
