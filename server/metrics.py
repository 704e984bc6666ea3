"""Prometheus collectors for the server, in a private registry so that tests and several apps in
one process never collide on the global one."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specdec_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. TTFT spans a CPU prefill of a long prompt; TPOT a single decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """Every collector the server exports. Safe to update from the engine thread and the event
    loop at once (prometheus-client locks internally)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(p + "requests_finished", "Generations by finish reason",
                                ["reason"], registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences the engine is running",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for admission",
                             registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate",
                                     "Prefix-cache hits over queries since start", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token",
                              ["method"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              ["method"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish",
                             ["method"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter(p + "spec_draft_tokens", "Draft tokens proposed",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted",
                                       ["method"], registry=r)
        self.accepted_per_position = Counter(
            p + "spec_accepted_tokens_per_position", "Draft tokens accepted at each depth",
            ["method", "position"], registry=r)
        self.verify_steps = Counter(p + "spec_verification_steps",
                                    "Target verification steps of speculating requests",
                                    ["method"], registry=r)
        # The goodput controller (specdec/spec_control.py), per drafter, since start.
        self.ctl_depth = Gauge(p + "spec_chosen_depth_steps", "Verifications by the draft "
                               "depth the controller chose", ["method", "depth"], registry=r)
        self.ctl_predicted = Gauge(p + "spec_predicted_tokens", "Tokens the controller "
                                   "expected its choices to emit", ["method"], registry=r)
        self.ctl_emitted = Gauge(p + "spec_emitted_tokens", "Tokens those verifications "
                                 "emitted", ["method"], registry=r)
        # A/B experiments (experiments/): one series per experiment and arm, from the records.
        ea = ["experiment", "arm"]
        self.exp_requests = Counter(p + "experiment_requests", "Requests an experiment "
                                    "assigned, by arm, once finished", ea, registry=r)
        self.exp_output_tokens = Counter(p + "experiment_output_tokens",
                                         "Output tokens of assigned requests", ea, registry=r)
        self.exp_draft_tokens = Counter(p + "experiment_draft_tokens",
                                        "Draft tokens of assigned requests", ea, registry=r)
        self.exp_accepted_tokens = Counter(p + "experiment_accepted_tokens",
                                           "Accepted draft tokens of assigned requests", ea,
                                           registry=r)
        self.exp_ttft = Histogram(p + "experiment_time_to_first_token_seconds",
                                  "Server arrival to first token of assigned requests", ea,
                                  buckets=_TTFT_BUCKETS, registry=r)
        self.exp_tpot = Histogram(p + "experiment_time_per_output_token_seconds",
                                  "Time per output token after the first, assigned requests",
                                  ea, buckets=_TPOT_BUCKETS, registry=r)

    def observe_experiment(self, experiment: str, arm: str, output_tokens: int,
                           draft_tokens: int, accepted_tokens: int, ttft_s: float | None,
                           tpot_s: float | None) -> None:
        """Record one finished request of an experiment's arm."""
        self.exp_requests.labels(experiment, arm).inc()
        self.exp_output_tokens.labels(experiment, arm).inc(output_tokens)
        self.exp_draft_tokens.labels(experiment, arm).inc(draft_tokens)
        self.exp_accepted_tokens.labels(experiment, arm).inc(accepted_tokens)
        if ttft_s is not None:
            self.exp_ttft.labels(experiment, arm).observe(max(0.0, ttft_s))
        if tpot_s is not None:
            self.exp_tpot.labels(experiment, arm).observe(max(0.0, tpot_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_engine(self, num_running: int, num_waiting: int, stats: dict[str, Any]) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        if "kv_blocks_used" in stats:
            self.kv_used.set(stats["kv_blocks_used"])
        if "kv_blocks_total" in stats:
            self.kv_total.set(stats["kv_blocks_total"])
        queries = stats.get("prefix_cache_queries") or 0
        if queries:
            self.prefix_hit_rate.set(stats.get("prefix_cache_hits", 0) / queries)
        for method, st in (stats.get("speculation_control") or {}).items():
            for depth, n in st["depth_histogram"].items():
                self.ctl_depth.labels(method, depth).set(n)
            self.ctl_predicted.labels(method).set(st["predicted_tokens"])
            self.ctl_emitted.labels(method).set(st["emitted_tokens"])

    def observe_finished(self, out: Any, now: float) -> None:
        """Record one finished (or aborted) request from its last RequestOutput."""
        spec = getattr(out, "spec", None)
        method = getattr(spec, "method", None) or "none"
        self.finished.labels(out.finish_reason or "unknown").inc()
        arrival = getattr(out, "arrival_time", None)
        first = getattr(out, "first_token_time", None)
        if arrival is not None:
            self.e2e.labels(method).observe(max(0.0, now - arrival))
            if first is not None:
                self.ttft.labels(method).observe(max(0.0, first - arrival))
        n = len(out.token_ids)
        if first is not None and n > 1:
            self.tpot.labels(method).observe(max(0.0, now - first) / (n - 1))
        if spec is not None and method != "none":
            self.draft_tokens.labels(method).inc(spec.draft_tokens)
            self.accepted_tokens.labels(method).inc(spec.accepted_tokens)
            self.verify_steps.labels(method).inc(spec.steps)
            for pos, count in enumerate(spec.accepted_per_position or ()):
                self.accepted_per_position.labels(method, str(pos)).inc(count)
