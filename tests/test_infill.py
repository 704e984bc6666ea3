"""Code completion: llama.cpp's /infill and /completion as the llama.vim and llama.vscode plugins
call them (against a fake engine, in process), the FIM prompt layout, and the stop rules of
specdec/stop_rules.py inside the engine's finish check."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from conftest_server import FakeEngine, FakeTokenizer
from test_server_unit import client, run

from server.prompts import PromptBuilder
from server.protocol import GenerationRequest
from specdec.detokenizer import IncrementalDetokenizer
from specdec.output_builder import OutputBuilder
from specdec.request import NO_SPECULATION, Request
from specdec.sampler import infill_filter
from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.stop_rules import SuffixRepeat, TextRules, past_budget

# The bodies the plugins send, field for field (llama.vim's autoload/llama.vim `llama#fim`, the
# version with speculative FIM; llama.vscode's LlamaServer request payload).
LLAMA_VIM = {
    "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": [{"text": "X = 1\n", "time": [1733000000, 5], "filename": "util.py"}],
    "prompt": "    ", "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
    "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
    "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
    "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                        "timings/prompt_per_token_ms", "timings/prompt_per_second",
                        "timings/predicted_n", "timings/predicted_ms",
                        "timings/predicted_per_token_ms", "timings/predicted_per_second",
                        "truncated", "tokens_cached"],
}
LLAMA_VIM_RING = {
    "input_prefix": "", "input_suffix": "", "input_extra": LLAMA_VIM["input_extra"],
    "prompt": "", "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": [],
    "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
}
LLAMA_VSCODE = {
    "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": [{"text": "X = 1\n", "time": 1733000000000, "filename": "/src/util.py"}],
    "prompt": "    ", "n_predict": 128, "top_k": 40, "top_p": 0.99, "stream": False,
    "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
    "t_max_prompt_ms": 500, "t_max_predict_ms": 500,
}
TIMINGS = ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second")


def post(body: dict[str, Any], path: str = "/infill", engine: FakeEngine | None = None
         ) -> Any:
    async def go() -> Any:
        async with client(engine or FakeEngine(max_model_len=4096)) as c:
            return await c.post(path, json=body)
    return run(go())


def test_llama_vim_request_gets_every_field_it_reads() -> None:
    r = post(LLAMA_VIM)
    body = r.json()
    assert r.status_code == 200, body
    # response_fields: flat keys named by their paths, nothing else.
    assert set(body) == set(LLAMA_VIM["response_fields"])
    assert body["content"] and isinstance(body["content"], str)
    assert all(isinstance(body[f"timings/{k}"], (int, float)) for k in TIMINGS)
    assert body["truncated"] is False and body["tokens_cached"] > 0
    # The warm-up of the extra context: n_predict 0, no fields wanted.
    r = post(LLAMA_VIM_RING)
    assert r.status_code == 200 and r.json() == {}


def test_llama_vscode_request_gets_every_field_it_reads() -> None:
    r = post(LLAMA_VSCODE)
    body = r.json()
    assert r.status_code == 200, body
    assert body["content"] and isinstance(body["tokens_cached"], int)
    assert isinstance(body["truncated"], bool)
    assert isinstance(body["generation_settings"]["n_ctx"], int)
    assert body["generation_settings"]["n_ctx"] == 4096
    assert all(isinstance(body["timings"][k], (int, float)) for k in TIMINGS)
    # llama.cpp's keys, and what the request asked
    for key in ("index", "tokens", "id_slot", "stop", "model", "tokens_predicted",
                "tokens_evaluated", "prompt", "has_new_line", "stop_type", "stopping_word"):
        assert key in body, key
    gs = body["generation_settings"]
    assert gs["samplers"] == ["top_k", "top_p", "infill"] and gs["n_indent"] == 4
    assert gs["t_max_predict_ms"] == 500 and gs["n_predict"] == 128
    # tokens_cached: the KV the request leaves, prompt plus output less the last token
    assert body["tokens_cached"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1
    assert body["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>/src/util.py\nX = 1\n")


def test_infill_stream_and_completion_shapes() -> None:
    r = post({"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 3, "stream": True})
    lines = [line for line in r.text.splitlines() if line]
    assert all(line.startswith("data: {") for line in lines)  # no [DONE]
    data = [json.loads(line[6:]) for line in lines]
    assert [d["content"] for d in data[:-1]] == ["a", "b", "c"]
    assert all(d["stop"] is False and len(d["tokens"]) == 1 for d in data[:-1])
    assert [d["tokens_predicted"] for d in data[:-1]] == [1, 2, 3]
    final = data[-1]
    assert final["stop"] is True and final["content"] == "" and final["stop_type"] == "limit"
    assert final["timings"]["predicted_n"] == 3

    r = post({"prompt": "hello", "n_predict": 4, "n_probs": 2, "return_tokens": True},
             "/completion")
    body = r.json()
    assert r.status_code == 200, body
    assert body["content"] == "abcd" and body["tokens"] == [97, 98, 99, 100]
    probs = body["completion_probabilities"]
    assert [p["token"] for p in probs] == ["a", "b", "c", "d"]
    assert len(probs[0]["top_logprobs"]) == 2 and probs[0]["bytes"] == [97]
    assert body["tokens_evaluated"] == 5 and body["prompt"] == "hello"
    r = post({"prompt": "hi", "n_predict": 9, "stop": ["d"]}, "/completion")
    assert (r.json()["content"], r.json()["stop_type"]) == ("abc", "word")


@pytest.mark.parametrize("body,param", [
    ({"input_prefix": 3}, "input_prefix"),
    ({"input_prefix": "x", "n_indent": "4"}, "n_indent"),
    ({"input_prefix": "x", "t_max_predict_ms": "fast"}, "t_max_predict_ms"),
    ({"input_prefix": "x", "samplers": 7}, "samplers"),
    ({"input_prefix": "x", "input_extra": [{"filename": "a"}]}, "input_extra[0].text"),
    ({"input_prefix": "x", "input_extra": "text"}, "input_extra"),
    ({"input_prefix": "x", "response_fields": "content"}, "response_fields"),
    ({"input_prefix": "x", "n_predict": -2}, "n_predict"),
    ({"input_prefix": "x", "cache_prompt": "yes"}, "cache_prompt"),
])
def test_infill_wrong_types_name_the_field(body: dict[str, Any], param: str) -> None:
    r = post(body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_fields_are_ignored_and_samplers_read_as_llama_cpp() -> None:
    r = post({"input_prefix": "x", "n_predict": 2, "lora": [{"id": 0, "scale": 0.5}],
              "samplers": "kt", "whatever": {"a": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["generation_settings"]["samplers"] == ["top_k", "temperature"]


# ---- the prompt -----------------------------------------------------------------------------

def builder(max_model_len: int = 4096) -> PromptBuilder:
    return PromptBuilder(FakeTokenizer(), max_model_len, eos_ids=(0,))


def infill(**kw: Any) -> GenerationRequest:
    return GenerationRequest(kind="infill", model=None, params=SamplingParams(max_tokens=8),
                             max_tokens_given=True, **kw)


def test_fim_prompt_layout_is_llama_cpps() -> None:
    pb = builder()
    p = pb.build(infill(input_prefix="ab", input_suffix="cd", prompt="  ",
                        input_extra=[{"filename": "f.py", "text": "x"}]))
    assert pb.decode(p.ids) == ("<|repo_name|>myproject\n<|file_sep|>f.py\nx"
                                "<|file_sep|>filename\n<|fim_prefix|>ab  <|fim_suffix|>cd"
                                "<|fim_middle|>")
    assert p.fim and p.fim_suffix == "cd" and not p.fim_line_start and not p.truncated
    params = pb.fit(infill(), p)
    assert {0, *pb.fim_end_ids} <= set(params.stop_token_ids)
    assert pb.fim["sep"] in params.stop_token_ids and pb.fim["repo"] in params.stop_token_ids
    assert params.fim_suffix == "cd"
    # OpenAI's suffix goes through the same builder
    oa = pb.build(GenerationRequest(kind="completion", model=None, params=SamplingParams(),
                                    max_tokens_given=False, prompt="ab  ", suffix="cd"))
    assert pb.decode(oa.ids) == ("<|repo_name|>myproject\n<|file_sep|>filename\n"
                                 "<|fim_prefix|>ab  <|fim_suffix|>cd<|fim_middle|>")
    assert oa.text == "ab  "


def test_fim_prompt_budget_keeps_the_prefix_end_and_the_suffix_start() -> None:
    pb = builder(max_model_len=4000)
    p = pb.build(infill(input_prefix="p" * 1600 + "END", input_suffix="START" + "s" * 600,
                        input_extra=[{"filename": "big", "text": "e" * 5000}]))
    text = pb.decode(p.ids)
    assert "END<|fim_suffix|>START" in text
    prefix = text.split("<|fim_prefix|>")[1].split("<|fim_suffix|>")[0]
    assert prefix == "p" * (1536 - 3) + "END"
    suffix = text.split("<|fim_suffix|>")[1].split("<|fim_middle|>")[0]
    assert suffix == "START" + "s" * (2048 // 4 - 2 - len("START"))  # the middle is empty
    assert len(p.ids) + 8 <= 4000 and p.truncated  # the extra context was cut to fit


# ---- stop rules ------------------------------------------------------------------------------

def test_suffix_repeat_rule() -> None:
    # Cursor at a line start: the suffix's first line must come back at a line start.
    r = SuffixRepeat.of("    return x\n\nprint(1)\n", cursor_at_line_start=True)
    assert r.find("    y = 1\n    return x\n", final=False) == len("    y = 1\n")
    assert r.find("    y = 1\n        return x\n", final=False) is None  # other indentation
    assert r.find("    y = 1\n    return x + 1\n", final=False) is None  # another line
    assert r.find("    y = 1\n    return x", final=False) is None  # could still go on
    assert r.find("    y = 1\n    return x", final=True) == len("    y = 1\n")
    assert r.find("    return x\n", final=False) == 0
    # Cursor inside a line: the rest of that line, then the next non-blank line.
    r = SuffixRepeat.of(")\n    return x\n", cursor_at_line_start=False)
    assert r.find("a, b)\n    return x\n", final=False) == 4
    assert r.holdback("a, b)\n    ret") == len(")\n    ret")
    assert r.holdback("a, b") == 0
    assert SuffixRepeat.of("  \n\n", cursor_at_line_start=True) is None
    assert SuffixRepeat.of(")", cursor_at_line_start=False) is None


def test_n_indent_rule_is_llama_cpps() -> None:
    rules = TextRules(n_indent=4, suffix=None)
    # The first line is never checked; a later line indented less is cut before its text.
    assert rules.find("x\n    y\n    z", final=False) is None
    assert rules.find("x\n    y\nclass A", final=False) == (len("x\n    y\n"), "length", None)
    assert rules.find("x\n  y", final=False) == (len("x\n  "), "length", None)
    assert rules.find("x\n\n    y", final=False) == (len("x\n"), "length", None)  # blank line
    assert rules.find("x\n   ", final=False) is None  # the line has no text yet


def test_budget_rule_is_llama_cpps() -> None:
    assert past_budget(["a", "b"], had_newline=False, budget_spent=False) is None
    assert past_budget(["a", "\n", "b", "c"], had_newline=False, budget_spent=True) == 3
    assert past_budget(["a", "b"], had_newline=True, budget_spent=True) == 1
    assert past_budget(["a", "b"], had_newline=False, budget_spent=True) is None


class CharTokenizer:
    """One token per character (ids are code points), for the detokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def settle(params: SamplingParams, steps: list[str], started: float | None = None,
           sent: list[str] | None = None) -> tuple[str, str | None, Any]:
    """Feed `steps` (each a step's new text, a token per character) through stop_check as
    the engine does; return (output text, finish reason, stop_reason). `sent` gets what a
    stream would have sent, step by step, and the output's tokens as text."""
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("#")], stops=params.stop,
                                   rules=TextRules.of(params))
    seq = Sequence("r", [ord("#")], params)
    req, builder = Request(seq, NO_SPECULATION, None, detok, None), OutputBuilder({0})
    for text in steps:
        now = time.monotonic()
        kept, reason = builder.stop_check(req, [ord(c) for c in text], now)
        if seq.first_token_time is None:
            seq.first_token_time = now if started is None else started
        seq.output_token_ids += kept
        delta = detok.add(kept, final=reason is not None)
        if sent is not None:
            sent.append(delta)
        if reason is not None:
            if sent is not None:
                sent.append("".join(chr(t) for t in seq.output_token_ids))
            return detok.text, reason, seq.stop_reason
    return detok.text, None, None


def test_rules_in_the_engine_stop_check() -> None:
    p = SamplingParams(max_tokens=100, fim_suffix="    return x\n", fim_line_start=True)
    text, reason, why = settle(p, ["    y = 1\n", "    ret", "urn x\n", "more"])
    assert (text, reason, why) == ("    y = 1\n", "stop", "    return x")
    # However the steps group the tokens, the stream sends the same text and the output keeps
    # the same tokens (up to the one where the cut falls), none of the repeat's indentation.
    text = "    y = 1\n    return x\n"
    for steps in ([text], list(text), ["    y = 1\n   ", " return", " x\n"]):
        sent: list[str] = []
        assert settle(p, steps, sent=sent)[:2] == ("    y = 1\n", "stop")
        assert "".join(sent[:-1]) == "    y = 1\n" and sent[-1] == "    y = 1\n "
    p = SamplingParams(max_tokens=100, n_indent=4)
    assert settle(p, ["a\n    b\n", "c = 1\n"])[:2] == ("a\n    b\n", "length")
    # The budget: spent an hour ago, checked at the next step once a newline was seen.
    p = SamplingParams(max_tokens=100, max_predict_ms=1000.0)
    past = time.monotonic() - 3600
    assert settle(p, ["ab", "cd\nef", "gh"], started=past) == ("abcd\ne", "length", "budget")
    assert settle(SamplingParams(max_tokens=100, max_predict_ms=1e9), ["ab\n", "cd"],
                  started=past)[1] is None


class Pieces:
    """Token texts for the infill sampler: id -> bytes."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def __call__(self, t: int) -> bytes:
        return self.texts[t].encode()


def test_infill_sampler_is_llama_cpps() -> None:
    import torch

    pieces = Pieces({0: "", 1: "ret", 2: "return", 3: " x", 4: "y", 5: "z", 6: "q", 7: "w",
                     8: "e"})
    eog = frozenset({0})
    # End tokens with enough mass: only they stay (3 * 0.1 * 5 > 0.9).
    p = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1, 0.0, 0, 0, 0])
    assert infill_filter(p, eog, pieces).tolist() == [1.0, 0, 0, 0, 0, 0, 0, 0, 0]
    # "ret" begins "return": the likelier of the two takes both; then the 0.2 floor drops "y"
    # and "z"; then 1 / (n_text + 1) = 1/3 drops " x" (0.21 / 0.99).
    p = torch.tensor([0.0, 0.40, 0.38, 0.21, 0.005, 0.005, 0, 0, 0])
    out = infill_filter(p, eog, pieces)
    assert out.tolist() == pytest.approx([0, 1.0, 0, 0, 0, 0, 0, 0, 0])
    p = torch.tensor([0.0, 0.30, 0.10, 0.30, 0.15, 0.15, 0, 0, 0])
    out = infill_filter(p, eog, pieces)
    assert out.tolist() == pytest.approx([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0, 0, 0, 0, 0])
    # No text candidate reaches 0.2: the end token alone.
    p = torch.tensor([0.002, 0.0, 0.0] + [0.998 / 6] * 6)
    assert infill_filter(p, eog, pieces).tolist() == [1.0] + [0] * 8


def test_llama_sampler_chain_becomes_sampling_params() -> None:
    from server.llama_api import parse_infill

    vim = parse_infill(LLAMA_VIM).params
    assert vim.infill and vim.temperature == 1.0 and vim.top_k == 40 and vim.top_p == 0.90
    assert vim.min_p == 0.0 and vim.n_indent == 4 and vim.max_predict_ms == 250.0
    default = parse_infill({"input_prefix": "x"}).params  # llama.cpp's default chain
    assert default.temperature == 0.8 and default.temperature_last and not default.infill
    assert (default.top_k, default.top_p, default.min_p) == (40, 0.95, 0.05)
    greedy = parse_infill({"input_prefix": "x", "temperature": 0, "n_predict": 0}).params
    assert greedy.greedy and greedy.max_tokens == 1


# ---- the rules end to end, in the engine, on a tiny model with FIM tokens ---------------------

@pytest.fixture(scope="module")
def tiny_fim(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from conftest_server import make_tiny_model

    from specdec import LLM

    return LLM(model=str(make_tiny_model(tmp_path_factory.mktemp("fim") / "m")),
               dtype="float32", device="cpu")


SPECS = [{"method": "none"}, {"method": "ngram", "num_speculative_tokens": 3}]


def test_rules_end_to_end(tiny_fim: Any) -> None:
    prompt = "import os\n"
    base = dict(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = tiny_fim.generate([prompt], SamplingParams(**base))[0]
    text, ids = plain.text, plain.token_ids
    first_nl = text.index("\n")  # the tiny model writes a line break early on this prompt
    line2 = text[first_nl + 1:]
    width = len(line2) - len(line2.lstrip(" "))
    decode = tiny_fim.engine.tokenizer.decode
    nl_token = next(i for i in range(len(ids)) if "\n" in decode(ids[:i + 1]))
    for spec in SPECS:
        def run(spec: dict = spec, **kw: Any) -> Any:
            return tiny_fim.generate([prompt], SamplingParams(**base, speculative=spec,
                                                              **kw))[0]
        # n_indent above the second line's indentation: cut before its text.
        out = run(n_indent=width + 1)
        assert (out.text, out.finish_reason) == (text[:first_nl + 1 + width], "length"), spec
        # The suffix starts with the output's first line: the middle is empty.
        out = run(fim_suffix=text[:first_nl] + "\nrest\n", fim_line_start=True)
        assert (out.text, out.finish_reason) == ("", "stop"), spec
        # A spent budget: the token after the first newline is the last.
        out = run(max_predict_ms=1e-3)
        assert out.token_ids == ids[:nl_token + 2] and out.finish_reason == "length", spec


def test_fim_end_tokens_of_a_real_tokenizer(tiny_fim: Any) -> None:
    tok = tiny_fim.engine.tokenizer
    pb = PromptBuilder(tok, 512, tiny_fim.engine.eos_token_ids)
    vocab = tok.get_vocab()
    assert pb.supports_fim
    assert {vocab["<|file_sep|>"], vocab["<|repo_name|>"], vocab["<|im_end|>"]} <= set(
        pb.fim_end_ids)
    p = pb.build(infill(input_prefix="a", input_suffix="b"))
    assert pb.decode(p.ids).endswith("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>")
