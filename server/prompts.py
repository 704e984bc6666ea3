"""Turns validated requests into prompt token ids: plain text, chat templates, fill-in-the-middle
and llama.cpp-style infill with extra files; and fits max_tokens into the context."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from server.protocol import APIError, GenerationRequest, invalid

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_REPO, FIM_FILE_SEP = "<|repo_name|>", "<|file_sep|>"


class PromptBuilder:
    """Owns a private copy of the tokenizer: the engine thread detokenizes with the original, and
    a Rust-backed fast tokenizer raises "Already borrowed" when two threads share it."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tok = copy.deepcopy(tokenizer)
        self.max_model_len = int(max_model_len)
        vocab = self.tok.get_vocab()
        self.special = {t: vocab[t] for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_REPO,
                                              FIM_FILE_SEP) if t in vocab}
        self._token_text: dict[int, str] = {}

    @property
    def supports_fim(self) -> bool:
        return all(t in self.special for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))

    def encode(self, text: str) -> list[int]:
        # As the engine does for text prompts: no BOS/EOS added by the tokenizer.
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tok.decode([token_id])
        return text

    def build(self, req: GenerationRequest) -> tuple[list[int], str]:
        """Return (prompt token ids, prompt text as echoed back)."""
        if req.kind == "chat":
            return self._chat(req.messages)
        if req.kind == "infill":
            return self._infill(req), ""
        if isinstance(req.prompt, list):
            vocab_size = len(self.tok)
            bad = next((t for t in req.prompt if t >= vocab_size), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is outside the vocabulary "
                              f"(size {vocab_size})")
            return list(req.prompt), self.decode(req.prompt)
        if req.suffix is not None:
            return self._fim([], req.prompt, req.suffix, ""), req.prompt
        return self.encode(req.prompt), req.prompt

    def _need_fim(self, param: str) -> None:
        if not self.supports_fim:
            raise invalid(param, "this model has no fill-in-the-middle tokens "
                          f"({FIM_PREFIX}, {FIM_SUFFIX}, {FIM_MIDDLE}) in its vocabulary")

    def _fim(self, extra: list[int], prefix: str, suffix: str, middle: str) -> list[int]:
        self._need_fim("suffix")
        s = self.special
        return (extra + [s[FIM_PREFIX]] + self.encode(prefix) + [s[FIM_SUFFIX]]
                + self.encode(suffix) + [s[FIM_MIDDLE]] + self.encode(middle))

    def _infill(self, req: GenerationRequest) -> list[int]:
        """Follows llama.cpp's layout: repository-level context from `input_extra` as
        <|file_sep|>name\\ntext chunks when the model has those tokens, then the FIM prompt."""
        self._need_fim("input_prefix")
        extra: list[int] = []
        sep = self.special.get(FIM_FILE_SEP)
        if req.input_extra:
            if FIM_REPO in self.special:
                extra += [self.special[FIM_REPO]] + self.encode("myproject\n")
            for chunk in req.input_extra:
                if sep is not None:
                    extra += [sep] + self.encode(chunk["filename"] + "\n")
                else:
                    extra += self.encode(f"\n\n--- snippet {chunk['filename']} ---\n\n")
                extra += self.encode(chunk["text"])
            if sep is not None:
                extra += [sep] + self.encode("filename\n")
        return self._fim(extra, req.input_prefix, req.input_suffix, req.prompt)

    def _chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        if not getattr(self.tok, "chat_template", None):
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
        except Exception as exc:
            raise invalid("messages", f"chat template failed: {exc}") from None
        return self.encode(text), text

    def fit(self, req: GenerationRequest, n_prompt: int) -> Any:
        """Return the request's SamplingParams with max_tokens fitted into the context."""
        room = self.max_model_len - n_prompt
        if room <= 0:
            raise APIError(413, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens, but the prompt has {n_prompt} tokens.", param="prompt",
                           code="context_length_exceeded")
        params = req.params
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
