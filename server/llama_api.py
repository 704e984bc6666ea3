"""llama.cpp's `/completion` and `/infill`, as `llama-server` answers them and as the llama.vim
and llama.vscode plugins call them: request fields, defaults, and response bodies, streamed and
not.

Where llama.cpp's semantics are ours too: `n_predict` (-1: until the context is full; 0: one
token, as llama.cpp's warm-up requests get), `n_indent` and `t_max_predict_ms`
(specdec/stop_rules.py), `samplers` (see `_samplers`), `n_probs`, `response_fields`,
`tokens_cached` (the KV the request leaves: prompt plus output, less the last token),
`timings.prompt_n` (prompt tokens computed, the rest came from the prefix cache),
`cache_prompt` (false: the prompt is computed in full; the prefix cache is exact, so only the
time differs). Accepted and not acted on, as in llama.cpp at the version the plugins target:
`t_max_prompt_ms`; and `id_slot` (no slots here: any request runs beside any other). Unknown
fields are ignored; a known field of the wrong type is a 400 naming it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from server.protocol import (
    UNSET_MAX_TOKENS,
    GenerationRequest,
    invalid,
    read_bool,
    read_num,
    read_speculative,
    read_str,
    read_token_ids,
)
from specdec.sampling_params import SamplingParams

# llama-server's sampler names, and the ones we apply (in our fixed order: penalties,
# temperature where the list puts it, top_k, top_p, min_p, infill). dry, typ_p and xtc are
# accepted and not applied; names llama.cpp does not know are ignored, as it ignores them.
SAMPLER_NAMES = {"dry", "top_k", "top_p", "typ_p", "min_p", "temperature", "xtc", "infill",
                 "penalties"}
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "p": "top_p", "y": "typ_p", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties"}
DEFAULT_SAMPLERS = ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                    "temperature")
# llama-server's defaults where a request leaves a field out.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass
class LlamaFields:
    """What the llama.cpp endpoints take beyond SamplingParams, for building the response."""

    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    response_fields: tuple[str, ...] = ()
    return_tokens: bool = False
    n_probs: int = 0
    n_predict: int = -1
    extra: dict[str, Any] = field(default_factory=dict)  # echoed in generation_settings


def _samplers(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("samplers")
    if v is None:
        return DEFAULT_SAMPLERS
    if isinstance(v, str):
        return tuple(SAMPLER_CHARS[c] for c in v if c in SAMPLER_CHARS)
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("samplers", "'samplers' must be a list of sampler names or a string of "
                      "sampler letters")
    return tuple(s for s in v if s in SAMPLER_NAMES)


def _sampling(body: dict[str, Any], n_predict: int) -> tuple[SamplingParams, LlamaFields]:
    samplers = _samplers(body)
    n_probs = read_num(body, "n_probs", 0, 0, 20, integer=True)
    t_predict = read_num(body, "t_max_predict_ms", -1, None, None)
    read_num(body, "t_max_prompt_ms", -1, None, None)  # checked, not acted on (see above)
    read_num(body, "id_slot", -1, -1, None, integer=True)
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list)
                               or not all(isinstance(f, str) for f in fields)):
        raise invalid("response_fields", "'response_fields' must be a list of strings")
    seed = read_num(body, "seed", None, -1, 2**64 - 1, integer=True)
    if seed in (-1, 0xFFFFFFFF):
        seed = None  # llama.cpp's "random"
    stop = body.get("stop")
    if stop is not None and (not isinstance(stop, list)
                             or not all(isinstance(s, str) for s in stop)):
        raise invalid("stop", "'stop' must be a list of strings")
    # A sampler missing from the list is off; temperature missing samples at 1, as llama.cpp's
    # chain then has no temperature step.
    temp = read_num(body, "temperature", DEFAULTS["temperature"], 0.0, 2.0) \
        if "temperature" in samplers else 1.0
    top_k = read_num(body, "top_k", DEFAULTS["top_k"], -1, None, integer=True) \
        if "top_k" in samplers else -1
    top_p = read_num(body, "top_p", DEFAULTS["top_p"], 0.0, 1.0) if "top_p" in samplers else 1.0
    min_p = read_num(body, "min_p", DEFAULTS["min_p"], 0.0, 1.0) if "min_p" in samplers else 0.0
    pen = "penalties" in samplers
    filters = [samplers.index(s) for s in ("top_k", "top_p", "min_p") if s in samplers]
    temperature_last = "temperature" in samplers and bool(filters) and \
        samplers.index("temperature") > max(filters)
    max_tokens = max(n_predict, 1) if n_predict >= 0 else UNSET_MAX_TOKENS
    try:
        params = SamplingParams(
            temperature=temp, top_k=-1 if top_k == 0 else top_k, top_p=top_p or 1e-6,
            min_p=min_p, temperature_last=temperature_last, infill="infill" in samplers,
            repetition_penalty=(read_num(body, "repeat_penalty", 1.0, 0.0, 10.0) or 1.0)
            if pen else 1.0,
            presence_penalty=read_num(body, "presence_penalty", 0.0, -2.0, 2.0) if pen else 0.0,
            frequency_penalty=read_num(body, "frequency_penalty", 0.0, -2.0, 2.0) if pen else 0.0,
            max_tokens=max_tokens, stop=tuple(s for s in (stop or []) if s),
            ignore_eos=read_bool(body, "ignore_eos"), seed=seed,
            logprobs=n_probs or None,
            n_indent=read_num(body, "n_indent", 0, 0, None, integer=True),
            max_predict_ms=float(t_predict) if t_predict > 0 else None,
            cache_prompt=read_bool(body, "cache_prompt", True),
            speculative=read_speculative(body))
    except ValueError as exc:
        raise invalid(str(exc).split(" ", 1)[0], str(exc)) from None
    return params, LlamaFields(
        samplers=samplers, response_fields=tuple(fields or ()),
        return_tokens=read_bool(body, "return_tokens"), n_probs=n_probs, n_predict=n_predict,
        extra={"n_indent": params.n_indent, "t_max_predict_ms": t_predict})


def _n_predict(body: dict[str, Any]) -> int:
    key = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    return read_num(body, key, -1, -1, None, integer=True)


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    """llama.cpp's /completion: `prompt` as a string or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = read_token_ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' must be a string or a list of token ids")
    if not prompt:
        raise invalid("prompt", "'prompt' must not be empty")
    n_predict = _n_predict(body)
    params, fields_ = _sampling(body, n_predict)
    return GenerationRequest(
        kind="llama_completion", model=None, params=params, max_tokens_given=n_predict >= 0,
        stream=read_bool(body, "stream"), prompt=prompt, llama=fields_)


def parse_infill(body: dict[str, Any]) -> GenerationRequest:
    """llama.cpp's /infill: input_prefix, input_suffix, input_extra, prompt, n_predict..."""
    extra = body.get("input_extra")
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise invalid("input_extra", "'input_extra' must be a list of {filename, text}")
    chunks = []
    for i, c in enumerate(extra):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise invalid(f"input_extra[{i}].text", "each 'input_extra' item must be an object "
                          "with a string 'text'")
        name = c.get("filename")
        if name is not None and not isinstance(name, str):
            raise invalid(f"input_extra[{i}].filename", "'filename' must be a string")
        chunks.append({"filename": name or "tmp", "text": c["text"]})
    n_predict = _n_predict(body)
    params, fields_ = _sampling(body, n_predict)
    return GenerationRequest(
        kind="infill", model=None, params=params, max_tokens_given=n_predict >= 0,
        stream=read_bool(body, "stream"), prompt=read_str(body, "prompt", "") or "",
        input_prefix=read_str(body, "input_prefix", "") or "",
        input_suffix=read_str(body, "input_suffix", "") or "", input_extra=chunks, llama=fields_)


# ---- responses ----------------------------------------------------------------------------

def _ratio(a: float, b: float) -> float | None:
    """a / b, or None (llama.cpp's null) where that is not a finite number."""
    return a / b if b and math.isfinite(a / b) else None


def _stop_type(out: Any) -> tuple[str, str]:
    reason = getattr(out, "finish_reason", None)
    why = getattr(out, "stop_reason", None)
    if reason == "stop":
        return ("word", why) if isinstance(why, str) else ("eos", "")
    if reason == "length":
        return "limit", ""
    return "none", ""


def timings(out: Any, n_prompt: int, n: int) -> dict[str, Any]:
    arrival = getattr(out, "arrival_time", None)
    first = getattr(out, "first_token_time", None)
    now = time.monotonic()
    prompt_ms = (first - arrival) * 1e3 if first is not None and arrival is not None else 0.0
    predicted_ms = (now - first) * 1e3 if first is not None else 0.0
    cached = getattr(out, "num_cached_tokens", 0) or 0
    prompt_n = max(n_prompt - cached, 0)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": _ratio(prompt_ms, prompt_n),
            "prompt_per_second": _ratio(1e3 * prompt_n, prompt_ms),
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": _ratio(predicted_ms, n),
            "predicted_per_second": _ratio(1e3 * n, predicted_ms)}


def generation_settings(params: SamplingParams, f: LlamaFields, n_ctx: int,
                        stream: bool) -> dict[str, Any]:
    return {"n_ctx": n_ctx, "n_predict": f.n_predict, "seed": params.seed,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "stop": list(params.stop),
            "max_tokens": f.n_predict, "n_keep": 0, "n_discard": 0,
            "ignore_eos": params.ignore_eos, "stream": stream, "n_probs": f.n_probs,
            "min_keep": 0, "samplers": list(f.samplers), **f.extra,
            "speculative": params.speculative}


def probabilities(pb: Any, entries: list[Any]) -> list[dict[str, Any]]:
    """llama.cpp's `completion_probabilities`."""
    from server.responses import logprob_entry

    def item(t: int, lp: float) -> dict[str, Any]:
        text = pb.token_text(t)
        return {"id": t, "token": text, "bytes": list(text.encode()), "logprob": lp}

    return [{**item(t, lp), "top_logprobs": [item(k, v) for k, v in top.items()]}
            for t, lp, top in map(logprob_entry, entries)]


def select_fields(body: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """`response_fields`: an object of the given paths ("timings/prompt_n"), keyed by the path
    itself; paths that do not exist are left out."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = body
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def final_body(choice: Any, n_prompt: int, prompt_text: str, params: SamplingParams,
               f: LlamaFields, model: str, n_ctx: int, stream: bool, truncated: bool,
               pb: Any) -> dict[str, Any]:
    """The whole response (the last event of a stream: its content and tokens already sent)."""
    out = choice.last
    n = choice.n_tokens
    stop_type, word = _stop_type(out)
    body: dict[str, Any] = {
        "index": 0, "content": "" if stream else choice.text,
        "tokens": list(out.token_ids) if f.return_tokens and out is not None and not stream
        else [],
        "id_slot": 0, "stop": True, "model": model, "tokens_predicted": n,
        "tokens_evaluated": n_prompt,
        "generation_settings": generation_settings(params, f, n_ctx, stream),
        "prompt": prompt_text, "has_new_line": "\n" in choice.text, "truncated": truncated,
        "stop_type": stop_type, "stopping_word": word,
        "tokens_cached": n_prompt + max(n - 1, 0),
        "timings": timings(out, n_prompt, n),
        "speculative": _spec(out),
    }
    if f.n_probs and not stream:
        body["completion_probabilities"] = probabilities(pb, choice.logprobs)
    return select_fields(body, f.response_fields) if f.response_fields else body


def partial_body(out: Any, n_prompt: int, f: LlamaFields, pb: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "index": 0, "content": out.delta_text, "tokens": list(out.delta_token_ids),
        "stop": False, "id_slot": -1, "tokens_predicted": len(out.token_ids),
        "tokens_evaluated": n_prompt}
    if f.n_probs and out.logprobs:
        body["completion_probabilities"] = probabilities(pb, list(out.logprobs))
    return body


def _spec(out: Any) -> dict[str, Any] | None:
    from server.responses import speculative_usage

    return speculative_usage([getattr(out, "spec", None)] if out is not None else [])
