"""Stop conditions on the output text beyond stop strings and stop tokens: those of code
completion. Each request that sets one gets a `TextRules`; the engine asks it, after every step,
where the output must end (`find`), and how much of the output's tail to hold back from a
stream while it could still turn out to be cut (`holdback`).

- `n_indent` (llama.cpp's /infill field): the output ends at a line after its first that is
  indented by fewer than n_indent spaces or tabs, cut before that line's first other character
  (a blank line counts as indented 0). As llama.cpp does, the cut keeps the line's newline and
  indentation.
- `fim_suffix` (fill-in-the-middle): the output ends where it repeats the start of the suffix,
  the text after the cursor. That start runs from the cursor through the suffix's first line
  that has more than whitespace (when the cursor is inside a line, the rest of that line comes
  first). It counts as repeated where the output holds it exactly, starting at a line start
  (or, when it begins inside the cursor's line, anywhere), followed by a newline or by the end
  of the output; the output is cut where the repeat begins.
- The time budget (llama.cpp's `t_max_predict_ms`) is counted in tokens, not text: see
  `past_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _indent(text: str, start: int) -> tuple[int, int]:
    """(width, offset of the first other character) of the line starting at `start`."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    return i - start, i


@dataclass(frozen=True)
class SuffixRepeat:
    """The start of a FIM suffix, and where an output repeats it."""

    pattern: str  # the suffix from the cursor through its first non-blank line
    line_start: bool  # the pattern must begin at a line start (or at the output's start)

    @classmethod
    def of(cls, suffix: str, cursor_at_line_start: bool) -> SuffixRepeat | None:
        lines = suffix.split("\n")
        first = 0 if cursor_at_line_start else 1  # inside a line: its rest comes first
        for i in range(first, len(lines)):
            if lines[i].strip():
                pattern = "\n".join(lines[:i + 1]).rstrip(" \t")
                # A pattern that starts at the cursor's line start needs a line start in the
                # output; one that starts with the rest of the cursor's line or a newline does
                # not (it already holds a newline and a whole line).
                anchored = cursor_at_line_start and not pattern.startswith("\n")
                return cls(pattern, anchored)
        return None

    def find(self, text: str, final: bool) -> int | None:
        p = self.pattern
        at = text.find(p)
        while at >= 0:
            if not self.line_start or at == 0 or text[at - 1] == "\n":
                end = at + len(p)
                rest = text[end:].lstrip(" \t")
                if rest.startswith("\n") or (final and not rest):
                    return at
            at = text.find(p, at + 1)
        return None

    def holdback(self, text: str) -> int:
        """How much of the tail of `text` could still turn out to be a repeat: the longest
        tail that begins the pattern, or the whole pattern and the spaces after it while its
        newline has not come."""
        p = self.pattern
        body = text.rstrip(" \t")
        if body.endswith(p):
            return len(text) - len(body) + len(p)
        for n in range(min(len(p) - 1, len(text)), 0, -1):
            if text.endswith(p[:n]):
                return n
        return 0


class TextRules:
    """The text stop conditions of one request (see the module's docstring)."""

    def __init__(self, n_indent: int, suffix: SuffixRepeat | None) -> None:
        self.n_indent = n_indent
        self.suffix = suffix

    @classmethod
    def of(cls, params: Any) -> TextRules | None:
        suffix = (SuffixRepeat.of(params.fim_suffix, params.fim_line_start)
                  if params.fim_suffix is not None else None)
        if params.n_indent <= 0 and suffix is None:
            return None
        return cls(params.n_indent, suffix)

    def find(self, text: str, final: bool) -> tuple[int, str, str | None] | None:
        """Where the output must end: (offset, finish reason, the text stopped on), or None.
        An n_indent cut finishes as "length" (llama.cpp's limit), a suffix repeat as "stop"."""
        cuts = []
        if self.n_indent > 0:
            at = text.find("\n")
            while at >= 0:
                width, first = _indent(text, at + 1)
                if first < len(text) and width < self.n_indent:
                    cuts.append((first, "length", None))
                    break
                at = text.find("\n", at + 1)
        if self.suffix is not None:
            at = self.suffix.find(text, final)
            if at is not None:
                cuts.append((at, "stop", self.suffix.pattern))
        return min(cuts, key=lambda c: c[0]) if cuts else None

    def holdback(self, text: str) -> int:
        return self.suffix.holdback(text) if self.suffix is not None else 0


def past_budget(new_texts: list[str], had_newline: bool, budget_spent: bool) -> int | None:
    """llama.cpp's `t_max_predict_ms`: once the budget is spent and the output holds a newline,
    generation stops after the token being produced. Given this step's new tokens' texts,
    return how many of them to keep, or None to keep going."""
    if not budget_spent:
        return None
    for i, t in enumerate(new_texts):
        if had_newline:
            return i + 1
        had_newline = "\n" in t
    return None
