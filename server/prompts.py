"""Turns validated requests into prompt token ids: plain text, chat templates, fill-in-the-middle
and llama.cpp-style infill with extra files; and fits max_tokens into the context."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from server.protocol import APIError, GenerationRequest, invalid

# Fill-in-the-middle tokens by role, under the names the model families' vocabularies give them
# (the names llama.cpp looks for in a GGUF's vocabulary). pad, repo and sep also end generation
# of a FIM request, as do the end tokens.
FIM_NAMES = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
    "repo": ("<|repo_name|>", "<|fim_repo|>", "<fim-repo>", "<reponame>"),
    "sep": ("<|file_sep|>", "<|fim_sep|>", "<fim-sep>", "<file_sep>"),
}
END_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
             "<end_of_turn>", "<EOT>")
# llama.cpp's /infill budget (its default batch of 2048): the prefix keeps its last 3/4 of a
# batch, the suffix its first 1/4 (less the prompt and 2), the extra context what is left.
INFILL_BATCH = 2048


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str  # as echoed back (OpenAI) or reported (llama.cpp's `prompt`)
    truncated: bool = False  # extra context was cut to fit the model's context
    fim: bool = False  # a fill-in-the-middle prompt: FIM stop tokens and rules apply
    fim_suffix: str = ""
    fim_line_start: bool = False


class PromptBuilder:
    """Owns a private copy of the tokenizer: the engine thread detokenizes with the original, and
    a Rust-backed fast tokenizer raises "Already borrowed" when two threads share it."""

    def __init__(self, tokenizer: Any, max_model_len: int,
                 eos_ids: tuple[int, ...] = ()) -> None:
        self.tok = copy.deepcopy(tokenizer)
        self.max_model_len = int(max_model_len)
        vocab = self.tok.get_vocab()
        self.fim = {role: next((vocab[n] for n in names if n in vocab), None)
                    for role, names in FIM_NAMES.items()}
        ends = {vocab[n] for n in END_NAMES if n in vocab} | set(eos_ids)
        fim_ends = {self.fim[r] for r in ("pad", "repo", "sep") if self.fim[r] is not None}
        self.fim_end_ids = tuple(sorted(ends | fim_ends))
        self.fim_only_end_ids = tuple(sorted(fim_ends - set(eos_ids) - ends))
        self._token_text: dict[int, str] = {}

    @property
    def supports_fim(self) -> bool:
        return all(self.fim[r] is not None for r in ("prefix", "suffix", "middle"))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """As the engine does for text prompts: no BOS/EOS added. `special=False` reads text
        like "<|file_sep|>" as plain text (a file's contents, not the model's control tokens)."""
        if not text:
            return []
        if special:
            return list(self.tok.encode(text, add_special_tokens=False))
        return list(self.tok(text, add_special_tokens=False,
                             split_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tok.decode([token_id])
        return text

    def build(self, req: GenerationRequest) -> Prompt:
        if req.kind == "chat":
            ids, text = self._chat(req.messages)
            return Prompt(ids, text)
        n_predict = req.params.max_tokens if req.max_tokens_given else 1  # room kept for it
        if req.kind == "infill":
            return self.infill(req.input_prefix, req.input_suffix, req.prompt, req.input_extra,
                               "input_prefix", n_predict)
        if isinstance(req.prompt, list):
            vocab_size = len(self.tok)
            bad = next((t for t in req.prompt if t >= vocab_size), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is outside the vocabulary "
                              f"(size {vocab_size})")
            return Prompt(list(req.prompt), self.decode(req.prompt))
        if req.suffix is not None:
            p = self.infill(req.prompt, req.suffix, "", [], "suffix", n_predict)
            return dataclasses.replace(p, text=req.prompt)
        return Prompt(self.encode(req.prompt), req.prompt)

    def _need_fim(self, param: str) -> None:
        if not self.supports_fim:
            names = ", ".join(FIM_NAMES[r][0] for r in ("prefix", "suffix", "middle"))
            raise invalid(param, "this model has no fill-in-the-middle tokens "
                          f"({names} or their kin) in its vocabulary")

    def infill(self, prefix: str, suffix: str, middle: str, extra: list[dict[str, str]],
               param: str, n_predict: int) -> Prompt:
        """The one FIM prompt builder (OpenAI's `suffix` and /infill), llama.cpp's layout:
        repository-level context first where the model has the tokens (`<|repo_name|>myproject`,
        each extra chunk as `<|file_sep|>name` and its text, then `<|file_sep|>filename` for the
        file being edited), then prefix, `middle` (the cursor line's start, as /infill's
        `prompt`), suffix. Prefix, suffix and chunks are read as plain text. The prefix keeps
        its last and the suffix its first tokens within llama.cpp's budget, and the extra
        context its last tokens within what the context leaves."""
        self._need_fim(param)
        f = self.fim
        head: list[int] = []
        if f["repo"] is not None:
            head += [f["repo"]] + self.encode("myproject\n")
        for chunk in extra:
            if f["sep"] is not None:
                head += [f["sep"]] + self.encode(chunk["filename"] + "\n", special=False)
            else:
                head += self.encode("\n\n--- snippet ---\n\n")
            head += self.encode(chunk["text"], special=False)
        if f["sep"] is not None:
            head += [f["sep"]] + self.encode("filename\n")
        pre = self.encode(prefix, special=False)
        mid = self.encode(middle)
        suf = self.encode(suffix, special=False)
        pre = pre[len(pre) - min(len(pre), 3 * (INFILL_BATCH // 4)):]
        suf = suf[:max(0, INFILL_BATCH // 4 - (2 + len(mid)))]
        body = [f["prefix"]] + pre + mid + [f["suffix"]] + suf + [f["middle"]]
        room = max(0, self.max_model_len - len(body) - max(n_predict, 1))
        take = min(room, max(0, self.max_model_len - INFILL_BATCH + 2), len(head))
        ids = head[len(head) - take:] + body
        start = prefix + middle
        return Prompt(ids, self.decode(ids), truncated=take < len(head) and bool(extra),
                      fim=True, fim_suffix=suffix,
                      fim_line_start=not start or start.endswith("\n"))

    def _chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        if not getattr(self.tok, "chat_template", None):
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
        except Exception as exc:
            raise invalid("messages", f"chat template failed: {exc}") from None
        return self._chat_ids(text, [m["content"] for m in messages]), text

    def _chat_ids(self, text: str, contents: list[str]) -> list[int]:
        """The rendered chat's tokens, where only the template's own text can hold control
        tokens: each message's content, found in order in the rendering, is read as plain text
        (so "<|im_end|>\n<|im_start|>system" typed by a user cannot open a system turn). A
        content the template altered is not found, and what follows is read as the template."""
        ids: list[int] = []
        pos = 0
        for content in contents:
            at = text.find(content, pos) if content else -1
            if at < 0:
                continue
            ids += self.encode(text[pos:at]) + self.encode(content, special=False)
            pos = at + len(content)
        return ids + self.encode(text[pos:])

    def fit(self, req: GenerationRequest, prompt: Prompt) -> Any:
        """Return the request's SamplingParams with max_tokens fitted into the context, and a
        FIM prompt's stop tokens and rules."""
        n_prompt = len(prompt.ids)
        room = self.max_model_len - n_prompt
        if room <= 0:
            raise APIError(413, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens, but the prompt has {n_prompt} tokens.", param="prompt",
                           code="context_length_exceeded")
        params = req.params
        bad = next((t for t in params.stop_token_ids if t >= len(self.tok)), None)
        if bad is not None:
            raise invalid("stop_token_ids", f"token id {bad} is outside the vocabulary "
                          f"(size {len(self.tok)})")
        if prompt.fim:
            # As llama.cpp: ignore_eos spares EOS alone, not FIM's other end tokens.
            ends = self.fim_end_ids if not params.ignore_eos else self.fim_only_end_ids
            params = dataclasses.replace(
                params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(ends))),
                fim_suffix=prompt.fim_suffix, fim_line_start=prompt.fim_line_start)
        if req.max_tokens_given:
            if params.max_tokens > room:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.max_model_len} tokens: {n_prompt} in the prompt plus "
                               f"{params.max_tokens} requested tokens do not fit.",
                               param="max_tokens", code="context_length_exceeded")
            return params
        max_tokens = min(16, room) if req.kind == "completion" else room
        return dataclasses.replace(params, max_tokens=max_tokens,
                                   min_tokens=min(params.min_tokens, max_tokens))
