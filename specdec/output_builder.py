"""Where a step's tokens become outputs: stop checks (`stop_check`) and detokenizing (`build`).

`stop_check` runs while a step is committed (what the next step depends on); `build` runs
after the next step has been launched, so that with overlap on the detokenizing of step n hides
behind the device's work on step n + 1 (specdec/engine.py).
"""

from __future__ import annotations

from specdec.outputs import RequestOutput
from specdec.request import Request
from specdec.stop_rules import past_budget


class OutputBuilder:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos = eos_token_ids

    def stop_check(self, r: Request, new: list[int], now: float | None = None
                   ) -> tuple[list[int], str | None]:
        """Cut `new` at r's first stop condition. Returns (tokens to keep, finish reason); sets
        `seq.stop_reason`. Tokens an earlier step appended may be taken back (`_cut_at_stop`)."""
        seq, p = r.seq, r.seq.params
        kept: list[int] = []
        reason = None
        for t in new:
            kept.append(t)
            n_out = len(seq.output_token_ids) + len(kept)
            if n_out >= p.min_tokens:
                if t in p.stop_token_ids:
                    reason, seq.stop_reason = "stop", t
                    break
                if not p.ignore_eos and t in self.eos:
                    reason = "stop"
                    break
            if n_out >= p.max_tokens:
                reason = "length"
                break
        detok = r.detok
        if p.max_predict_ms is not None and now is not None and seq.first_token_time is not None \
                and (now - seq.first_token_time) * 1e3 >= p.max_predict_ms:
            had_newline = "\n" in detok.decode_output(seq.output_token_ids)
            keep = past_budget([detok.decode_output([t]) for t in kept], had_newline, True)
            if keep is not None and (reason is None or keep < len(kept)):
                kept, reason, seq.stop_reason = kept[:keep], "length", "budget"
        if p.stop or detok.rules is not None:
            found = detok.find_stop(seq.output_token_ids + kept, final=reason is not None)
            if found is not None:
                at, why, word = found
                seq.stop_reason = word if why == "stop" else "n_indent"
                return _cut_at_stop(r, kept, at), why
        return kept, reason

    @staticmethod
    def build(r: Request, new_ids: list[int], logprobs, finished: bool) -> RequestOutput:
        """r's output after a step that appended `new_ids` (detokenized here)."""
        seq = r.seq
        delta = r.detok.add(new_ids, final=finished)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=r.detok.text, delta_token_ids=new_ids,
            delta_text=delta, finished=finished, finish_reason=seq.finish_reason,
            logprobs=logprobs, spec=r.metrics, num_cached_tokens=seq.num_cached_prompt_tokens,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            stop_reason=seq.stop_reason, error=r.error)


def _cut_at_stop(r: Request, kept: list[int], at: int) -> list[int]:
    """Keep the fewest tokens whose text reaches the stop offset `at` (the text from there is
    not output). The stop may begin in tokens an earlier step appended (a rule that waits for
    a line end, a stop string split over steps): those are taken back too, so the output's
    tokens are the same however steps grouped them (plain or speculative)."""
    seq, detok = r.seq, r.detok
    ids = seq.output_token_ids + kept
    n = len(ids)
    while n > 0 and len(detok.decode_output(ids[:n - 1])) > at:
        n -= 1
    old = len(seq.output_token_ids)
    if n < old:
        seq.output_token_ids = seq.output_token_ids[:n]  # a new list: Sequence.tokens rebuilds
        return []
    return kept[:n - old]
