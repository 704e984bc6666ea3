"""The request bodies of the server's OpenAPI document (server/openapi.py), as JSON Schema.

They describe the server as it was started (`Served`): the served model's name and context, its
vocabulary, and the speculation it can run (per method, the options each drafter takes, with
types and bounds). Constraints between fields that JSON Schema cannot state (a prompt's length
in tokens, `min_n` not above `max_n`, ...) are in descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drafters import DRAFTERS, drafter_class
from drafters.base import AUTO_DRAFTERS, COMMON_OPTIONS, Option


@dataclass(frozen=True)
class Served:
    """What the document describes beyond the endpoints themselves."""

    model_name: str
    max_model_len: int = 1 << 20
    vocab_size: int | None = None  # None: token ids are checked by the server alone
    auth: bool = False  # started with --api-key
    experiments: bool = False
    draft_models: tuple[str, ...] = ()
    default_draft_model: bool = False  # a draft_model request may leave its model out
    eagle_heads: tuple[str, ...] = ()


def _num(desc: str, lo: float | None = None, hi: float | None = None,
         integer: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer" if integer else "number", "description": desc}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _optional(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The generation endpoints read a null field as a field left out."""
    return {k: v if k in required else _nullable(v) for k, v in props.items()}


def _nullable(s: dict[str, Any]) -> dict[str, Any]:
    s = {**s, "nullable": True}
    if "enum" in s:
        s["enum"] = [*s["enum"], None]
    return s


# ---- speculation -----------------------------------------------------------------------------

_KINDS = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object"}
_RATE = r"(0(\.[0-9]+)?|1(\.0*)?|\.[0-9]+)"
_NOTES = {"min_n": "At most max_n", "max_n": "At least min_n",
          "survival": "Comma-separated survival rates per depth, non-increasing, in [0, 1]",
          "script": "Replay script (an object)"}


def _option(key: str, opt: Option) -> dict[str, Any]:
    s: dict[str, Any] = {"type": _KINDS[opt.kind]}
    if opt.lo is not None:
        s.update(minimum=opt.lo, maximum=opt.hi)
    if key in _NOTES:
        s["description"] = _NOTES[key]
    if key == "survival":
        s["pattern"] = f"^{_RATE}(,{_RATE})*$"
    return s


def speculative_schema(served: Served, *, file_alias: bool = False) -> dict[str, Any]:
    """A `speculative` object: one variant per method this server can run, each taking exactly
    that method's options (as drafters.check_speculative). `file_alias`: an experiment arm,
    which may say `k` for `num_speculative_tokens` (not both)."""
    names = {"draft_model": list(served.draft_models), "eagle_head": list(served.eagle_heads)}
    methods = ["ngram", "none", "auto", "replay"]
    methods += [m for m, key in (("draft_model", "draft_model"), ("eagle", "eagle_head"))
                if names[key]]
    variants = []
    for method in methods:
        options = dict(COMMON_OPTIONS)
        if method == "auto":
            for m in AUTO_DRAFTERS:
                options.update(drafter_class(m).options)
        elif method in DRAFTERS:
            options.update(drafter_class(method).options)
        props: dict[str, Any] = {}
        for key, opt in options.items():
            if key in names:
                if names[key]:
                    props[key] = {"type": "string", "enum": names[key]}
                continue
            props[key] = _option(key, opt)
        props["method"] = {"type": "string", "enum": [method]}
        variant: dict[str, Any] = {"type": "object", "properties": props,
                                   "additionalProperties": False}
        required = [] if method == "ngram" else ["method"]  # ngram is the default
        if method == "draft_model" and not served.default_draft_model:
            required.append("draft_model")
        if method == "eagle":
            required.append("eagle_head")
        if required:
            variant["required"] = required
        if file_alias:
            props["k"] = {**props["num_speculative_tokens"],
                          "description": "Alias of num_speculative_tokens"}
            variant["not"] = {"required": ["k", "num_speculative_tokens"]}
        variants.append(variant)
    return {"description": "Speculation: 'method' (default ngram) and that method's options. "
            "Methods here: " + ", ".join(methods), "anyOf": variants}


# ---- request bodies --------------------------------------------------------------------------

def _token_ids(served: Served, desc: str) -> dict[str, Any]:
    item = _num("A token id", 0, None if served.vocab_size is None else served.vocab_size - 1,
                integer=True)
    return {"type": "array", "items": item, "description": desc}


_TEXT = {"type": "string", "maxLength": 256}


def _sampling(served: Served) -> dict[str, Any]:
    return {
        "model": {"type": "string", "enum": [served.model_name],
                  "description": "The served model's id (another is a 404)"},
        "temperature": _num("0 is greedy", 0, 2),
        "top_p": _num("Nucleus sampling mass", 0, 1),
        "top_k": _num("-1 or 0 disables", -1, integer=True),
        "min_p": _num("Minimum probability relative to the top token", 0, 1),
        "presence_penalty": _num("OpenAI presence penalty", -2, 2),
        "frequency_penalty": _num("OpenAI frequency penalty", -2, 2),
        "repetition_penalty": _num("Multiplicative repetition penalty (1 is off)", 0, 10),
        "stop": {"description": "Up to 16 strings that end generation (not included in the "
                 "output)", "oneOf": [_TEXT, {"type": "array", "items": _TEXT,
                                              "maxItems": 16}]},
        "stop_token_ids": {**_token_ids(served, "Token ids that end generation"),
                           "maxItems": 64},
        "ignore_eos": {"type": "boolean"},
        "seed": _num("Sampling seed; with n > 1 choice i uses seed + i", -(2**63), 2**63 - 1,
                     integer=True),
        "n": _num("Number of choices", 1, 16, integer=True),
        "stream": {"type": "boolean", "description": "Server-sent events ending in data: [DONE]"},
        "stream_options": {"type": "object",
                           "properties": {"include_usage": _nullable({"type": "boolean"})}},
        "speculative": speculative_schema(served),
        "user": {"type": "string", "description": "End-user id (an experiment's unit)"},
    }


def _max_tokens(served: Served, desc: str, bounded: bool = True) -> dict[str, Any]:
    """`bounded`: the field is always the one used, so one not below the context never fits."""
    return _num(f"{desc}; the prompt's tokens plus these must fit the context "
                f"({served.max_model_len} tokens)", 1,
                served.max_model_len - 1 if bounded else None, integer=True)


def completion_schema(served: Served) -> dict[str, Any]:
    def text(min_length: int) -> list[dict[str, Any]]:
        string = {"type": "string", "minLength": min_length}
        return [string, {"type": "array", "minItems": 1, "maxItems": 1, "items": string}]

    ids = {**_token_ids(served, "Token ids"), "minItems": 1}
    props = {
        "prompt": {"description": "Text (empty only with a suffix), token ids, or a list of "
                   "one of either; the prompt must be shorter than the context "
                   f"({served.max_model_len} tokens)",
                   "oneOf": [*text(0), ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                             "items": ids}]},
        "suffix": {"type": "string", "description": "Fill-in-the-middle: text after the "
                   "cursor; needs a text prompt, and no echo"},
        "max_tokens": _max_tokens(served, "Default 16"),
        "logprobs": _num("Top-n log-probabilities per token", 0, 20, integer=True),
        "echo": {"type": "boolean"},
        **_sampling(served)}
    no_suffix = {"anyOf": [{"not": {"required": ["suffix"]}},
                           {"properties": {"suffix": {"enum": [None], "nullable": True}}}]}
    return {"type": "object", "required": ["prompt"], "properties": _optional(props, ("prompt",)),
            "anyOf": [
                # Without a suffix: any prompt but empty text.
                {**no_suffix, "properties": {"prompt": {"oneOf": [
                    *text(1), *props["prompt"]["oneOf"][2:]]}}},
                # With one: a text prompt, and no echo.
                {"required": ["suffix"], "properties": {
                    "suffix": {"type": "string"}, "prompt": {"oneOf": text(0)},
                    "echo": {"enum": [False, None], "nullable": True}}}]}


def chat_schema(served: Served) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]},
                           "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _nullable({"oneOf": [{"type": "string"},
                                        {"type": "array", "items": part}]}),
        "name": _nullable({"type": "string"})}}
    props = {
        "messages": {"type": "array", "minItems": 1, "items": message,
                     "description": "Rendered with the model's chat template; the result must "
                     f"be shorter than the context ({served.max_model_len} tokens)"},
        "max_tokens": _max_tokens(served, "Default: the rest of the context", bounded=False),
        "max_completion_tokens": _max_tokens(served, "Alias of max_tokens (this one wins)",
                                             bounded=False),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _num("Needs logprobs: true", 0, 20, integer=True),
        **_sampling(served)}
    return {"type": "object", "required": ["messages"],
            "properties": _optional(props, ("messages",)),
            # top_logprobs (not null) needs logprobs: true.
            "anyOf": [{"not": {"required": ["top_logprobs"]}},
                      {"properties": {"top_logprobs": {"enum": [None], "nullable": True}}},
                      {"required": ["logprobs"], "properties": {"logprobs": {"enum": [True]}}}]}


def _llama_common(served: Served) -> dict[str, Any]:
    sampling = _sampling(served)
    return {
        "n_predict": _num("-1: until the context is full; 0: one token; the prompt's tokens "
                          "plus these must fit the context", -1, served.max_model_len - 1,
                          integer=True),
        "n_indent": _num("Stop at a later line indented less than this", 0, integer=True),
        "t_max_predict_ms": _num("Once spent (from the first token), stop after the next token "
                                 "that follows a newline", None),
        "t_max_prompt_ms": _num("Accepted, not acted on (as llama.cpp)", None),
        "id_slot": _num("Accepted, not acted on (no slots here)", -1, integer=True),
        "samplers": {"description": "llama.cpp sampler names or letters; applied: penalties, "
                     "temperature, top_k, top_p, min_p, infill",
                     "oneOf": [{"type": "array", "items": {"type": "string"}},
                               {"type": "string"}]},
        "cache_prompt": {"type": "boolean", "description": "false: compute the whole prompt"},
        "n_probs": _num("Top-n log-probabilities (completion_probabilities)", 0, 20,
                        integer=True),
        "response_fields": {"type": "array", "items": {"type": "string"},
                            "description": "Paths such as 'timings/prompt_n': the response "
                            "holds only these, keyed by path"},
        "return_tokens": {"type": "boolean"},
        "repeat_penalty": _num("Alias of repetition_penalty", 0, 10),
        "stop": {"type": "array", "items": {"type": "string"},
                 "description": "Strings that end generation"},
        "seed": _num("Sampling seed; -1 or 4294967295: random", -1, 2**64 - 1, integer=True),
        **{k: sampling[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                    "frequency_penalty", "ignore_eos", "stream", "speculative",
                                    "user")}}


def infill_schema(served: Served) -> dict[str, Any]:
    extra = {"type": "object", "required": ["text"], "properties": {
        "filename": _nullable({"type": "string"}), "text": {"type": "string"}}}
    props = {"input_prefix": {"type": "string"}, "input_suffix": {"type": "string"},
             "input_extra": {"type": "array", "items": extra},
             "prompt": {"type": "string", "description": "The cursor line's start, after the "
                        "prefix"},
             **_llama_common(served)}
    return {"type": "object", "description": "llama.cpp's /infill request",
            "properties": _optional(props)}


def llama_completion_schema(served: Served) -> dict[str, Any]:
    props = {"prompt": {"description": "Text or token ids, not empty; shorter than the context "
                        f"({served.max_model_len} tokens)",
                        "oneOf": [{"type": "string", "minLength": 1},
                                  {**_token_ids(served, "Token ids"), "minItems": 1}]},
             **_llama_common(served)}
    return {"type": "object", "description": "llama.cpp's /completion request",
            "required": ["prompt"], "properties": _optional(props, ("prompt",))}


# ---- responses -------------------------------------------------------------------------------
