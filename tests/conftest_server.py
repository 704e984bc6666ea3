"""Helpers for the server tests: a tiny random Qwen2 checkpoint with a real tokenizer, a fake
engine honouring LLMEngine's contract, and a server process fixture."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # the openai client of some installs ships its own fork under this name
    import httpx2 as httpx  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>",
              "<|file_sep|>"]


def make_tiny_model(dst: Path, fim: bool = True, seed: int = 0) -> Path:
    """A 2-layer, 64-wide random Qwen2 whose tokenizer is the smollm2-135m preset's (plus the
    Qwen FIM tokens when `fim`). Large init keeps greedy argmaxes far from ties, so outputs are
    the same whatever the batch shape of the pass that produced them."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from specdec.hub import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    if fim:
        tok.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    dst.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(dst)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=0.2,
                      tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A `python -m server` child on a loopback port."""

    args: list[str]
    port: int = field(default_factory=free_port)
    module: str = "server"  # what `python -m` runs (tests/fault_server.py injects faults)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_path: Path, timeout: float = 180.0) -> ServerProcess:
        return self.launch(log_path).wait_healthy(timeout)

    def launch(self, log_path: Path) -> ServerProcess:
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        # No test server reads or writes the user's experiments (--experiments-db overrides).
        env.setdefault("SPECDEC_EXPERIMENTS_DB", ":memory:")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def serving(self, log_path: Path) -> Iterator[ServerProcess]:
        """A fixture's body: start, hand the server out, and check it stopped cleanly."""
        self.start(log_path)
        try:
            yield self
        finally:
            code = self.stop()
        assert code == 0, self.log()


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(values: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in values.items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


# ---- a fake engine honouring LLMEngine's contract, for fast in-process tests ----------------

class FakeTokenizer:
    """Characters are tokens (id = code point < 256); FIM tokens follow when `fim`."""

    chat_template = "fake"

    def __init__(self, fim: bool = True) -> None:
        self.specials = {t: 256 + i for i, t in enumerate(FIM_TOKENS)} if fim else {}
        self.names = {i: t for t, i in self.specials.items()}

    def __len__(self) -> int:
        return 256 + len(self.specials)

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, **self.specials}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def __call__(self, text: str, add_special_tokens: bool = False,
                 split_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.names.get(i, "") if i >= 256 else chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            tokenize: bool = False) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@dataclass
class FakeSpec:
    method: str
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.emitted_tokens / self.steps if self.steps else 0.0


@dataclass
class FakeOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[tuple[int, float, dict[int, float]]] | None = None
    spec: FakeSpec | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    stop_reason: Any = None
    error: str | None = None


class FakeEngine:
    """Writes the alphabet, one letter per step (two when speculating, to exercise the
    counters). A prompt containing "POISON" makes the step that first runs it raise."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz"

    def __init__(self, max_model_len: int = 64, max_num_seqs: int = 4, fim: bool = True,
                 step_s: float = 0.002) -> None:
        self.tokenizer = FakeTokenizer(fim)
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.seqs: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.only: set[str] | None = None  # run_only

    @property
    def running(self) -> list[str]:
        return [r for r in self.order if self.only is None or r in self.only][:self.max_num_seqs]

    @property
    def request_ids(self) -> list[str]:
        return list(self.order)

    def run_only(self, request_ids: set[str] | None) -> None:
        self.only = None if request_ids is None else set(request_ids)

    def fail_request(self, request_id: str, message: str) -> None:
        if request_id in self.seqs:
            self.seqs[request_id].update(aborted=True, error=message)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self.order) - self.max_num_seqs)

    def has_unfinished(self) -> bool:
        return bool(self.order)

    def stats(self) -> dict[str, Any]:
        used = sum(1 + len(self.seqs[r]["out"]) // 16 for r in self.running)
        return {"kv_blocks_used": used, "kv_blocks_total": 100, "prefix_cache_queries": 4,
                "prefix_cache_hits": 1}

    def add_request(self, request_id: str, prompt: str | list[int], params: Any) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens")
        spec = params.speculative or {}
        method = spec.get("method", "none")
        if method not in ("none", "ngram", "draft_model", "eagle"):
            raise ValueError(f"unknown speculative method {method!r}")
        self.seqs[request_id] = {
            "prompt": ids, "params": params, "out": [], "text": "", "aborted": False,
            "poison": "POISON" in self.tokenizer.decode(ids), "arrival": time.monotonic(),
            "first": None, "spec": FakeSpec(method) if method != "none" else None}
        self.order.append(request_id)

    def abort_request(self, request_id: str) -> None:
        if request_id in self.seqs:
            self.seqs[request_id]["aborted"] = True

    def step(self) -> list[FakeOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid in list(self.running):
            s = self.seqs[rid]
            if s["aborted"]:
                outs.append(self._finish(rid, [], "error" if s.get("error") else "abort"))
                continue
            if s["poison"]:
                raise RuntimeError("poisoned request")
            p = s["params"]
            n = 2 if s["spec"] else 1
            new = []
            for _ in range(n):
                if len(s["out"]) + len(new) < p.max_tokens:
                    new.append(ord(self.ALPHABET[(len(s["out"]) + len(new)) % 26]))
            s["out"] += new
            s["text"] = self.tokenizer.decode(s["out"])
            s["first"] = s["first"] or time.monotonic()
            if s["spec"]:
                s["spec"].steps += 1
                s["spec"].draft_tokens += 2
                s["spec"].accepted_tokens += len(new) - 1
                s["spec"].emitted_tokens += len(new)
                s["spec"].accepted_per_position = [s["spec"].steps]
            reason = None
            hit = next((x for x in p.stop if x in s["text"]), None)
            if hit is not None:
                s["text"] = s["text"][:s["text"].index(hit)]
                reason = "stop"
                s["stop_reason"] = hit
            elif len(s["out"]) >= p.max_tokens:
                reason = "length"
            outs.append(self._finish(rid, new, reason))
        return outs

    def _finish(self, rid: str, new: list[int], reason: str | None) -> FakeOutput:
        s = self.seqs[rid]
        lp = [(t, -0.5, {t: -0.5, 32: -1.5}) for t in new] if s["params"].logprobs is not None \
            else None
        prev = s.get("sent", "")
        s["sent"] = s["text"]
        out = FakeOutput(rid, s["prompt"], list(s["out"]), s["text"], new,
                         s["text"][len(prev):], reason is not None, reason, lp, s["spec"], 0,
                         s["arrival"], s["first"], s.get("stop_reason"), s.get("error"))
        if reason is not None:
            self.order.remove(rid)
            del self.seqs[rid]
        return out
