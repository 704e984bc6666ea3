"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import Any

from specdec.stop_rules import TextRules


class IncrementalDetokenizer:
    """Decodes a growing token list, emitting text only once it is stable.

    A byte-level BPE token may end inside a UTF-8 character; its decoded text then ends with
    U+FFFD. Such a tail is held back until the following tokens complete the character. So is a
    tail that could be the start of a stop string or of a text rule's cut (specdec/stop_rules.py),
    and a found stop ends the text."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stops: tuple[str, ...] = (), rules: TextRules | None = None) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stops = stops
        self.rules = rules
        self.ids: list[int] = []
        self.text = ""  # text sent so far
        self.full = ""  # stable text decoded so far (may run ahead of `text`)
        self.stop_at: int | None = None  # character offset where a stop string begins
        # The Rust tokenizer directly: the Python wrapper's per-call overhead dominates
        # when every running sequence decodes every step.
        self._fast = getattr(tokenizer, "_tokenizer", None)
        # Decode with a little prompt context so leading spaces come out right.
        self.prefix_ids = prompt_ids[-4:]
        self._prefix_text = self._decode(self.prefix_ids)
        # Window offsets into prefix_ids + ids: only the tail since `read` is decoded anew.
        self._window = 0
        self._read = len(self.prefix_ids)

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip,
                               clean_up_tokenization_spaces=False)

    def decode_output(self, ids: list[int]) -> str:
        full = self._decode(self.prefix_ids + ids)
        if full.startswith(self._prefix_text):
            return full[len(self._prefix_text):]
        return self._decode(ids)

    def find_stop(self, ids: list[int], final: bool) -> tuple[int, str, str | None] | None:
        """The first stop string or text rule's cut in the text of `ids`: (offset, finish
        reason, the text stopped on). Stop strings are searched only in new text."""
        text = self.decode_output(ids)
        found: list[tuple[int, str, str | None]] = []
        if self.stops:
            start = max(0, len(self.text) - max(len(s) for s in self.stops))
            found = [(at, "stop", s) for s in self.stops if (at := text.find(s, start)) >= 0]
        if self.rules is not None:
            cut = self.rules.find(text, final)
            if cut is not None:
                found.append(cut)
        if not found:
            return None
        first = min(found, key=lambda c: c[0])
        self.stop_at = first[0]
        return first

    def _advance(self) -> None:
        """Extend `full` by the stable text of tokens since the read offset."""
        total = len(self.prefix_ids) + len(self.ids)
        before = self._decode(self._window_ids(self._window, self._read))
        after = self._decode(self._window_ids(self._window, total))
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(
                before):
            self.full += after[len(before):]
            self._window, self._read = self._read, total

    def _window_ids(self, start: int, stop: int) -> list[int]:
        """(prefix_ids + ids)[start:stop], without copying the whole, growing, list."""
        n = len(self.prefix_ids)
        return self.prefix_ids[start:stop] + self.ids[max(0, start - n):max(0, stop - n)]

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        self._advance()
        full = self.full
        if final:
            full = self.decode_output(self.ids)
        if self.stop_at is not None:
            full = full[:self.stop_at]
        elif not final:
            full = full.rstrip("\ufffd")
            held = self._stop_prefix_len(full)
            if self.rules is not None:
                held = max(held, self.rules.holdback(full))
            full = full[:len(full) - held]
        if not full.startswith(self.text):
            return ""  # never take back text already sent
        delta = full[len(self.text):]
        self.text = full
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
