"""Logits processing shared by plain decoding, verification and draft models.

`process_logits` turns raw logits into the distribution a request samples from: penalties,
temperature, then top-k, top-p and min-p filtering (or, for `temperature_last` rows, the filters
on the untempered distribution and the temperature over what they keep). Greedy rows
(temperature 0) come back as a one-hot of their (penalised) argmax, so acceptance needs no
separate greedy path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.sampling_params import SamplingParams


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device: `torch.tensor(x,
    device=cuda)` synchronises the stream, which would stall a step launched ahead
    (specdec/chaining.py)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


@dataclass
class HostCopy:
    """A device tensor on its way to the host: a pinned copy queued behind the work that makes
    it (CUDA), or the tensor itself (CPU). `tolist` waits for the copy, not the whole stream."""

    host: torch.Tensor
    done: Any  # torch.cuda.Event recorded after the copy; None on the CPU

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def device_to_host(t: torch.Tensor) -> HostCopy:
    """Queue `t`'s copy to the host without waiting for it (see HostCopy)."""
    if not t.is_cuda:
        return HostCopy(t, None)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


@dataclass(frozen=True)
class RowContext:
    """What a logits row's penalties depend on: the tokens before the position it predicts."""

    prompt: Sequence[int]
    output: Sequence[int]  # generated tokens, including draft-path tokens for tree rows


def row_contexts(
    completing: Sequence[Any],  # sequences whose prefill completes: one row each
    decoding: Sequence[tuple[Any, list[int], list[int]]],  # (sequence, draft tokens, parents)
) -> list[RowContext]:
    """Per logits row, in sampling order, the tokens its penalties see: a decode's root row
    sees the sequence, each draft node's row adds the draft path down to that node."""
    rows = [RowContext(s.prompt_token_ids, s.output_token_ids) for s in completing]
    for s, toks, pars in decoding:
        rows.append(RowContext(s.prompt_token_ids, s.output_token_ids))
        for n in range(len(toks)):
            path, node = [], n
            while node >= 0:
                path.append(toks[node])
                node = pars[node]
            rows.append(RowContext(s.prompt_token_ids, s.output_token_ids + path[::-1]))
    return rows


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32, modified in place
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext],
) -> None:
    vocab = logits.shape[1]
    for i, (p, ctx) in enumerate(zip(params, contexts)):
        if not p.has_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ctx.prompt) | set(ctx.output)), dtype=torch.long,
                                device=row.device)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(ctx.output):
            out = torch.tensor(list(ctx.output), dtype=torch.long, device=row.device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """torch.argmax(x, dim=-1), through verify_kernels/argmax.py on CUDA (PyTorch's one-block
    reduction of a 128k row takes ~38 us on the H200)."""
    if x.device.type != "cuda" or x.dim() != 2 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    from verify_kernels.argmax import argmax_triton

    return argmax_triton(x)


def greedy_tokens(
    logits: torch.Tensor,  # [R, V] raw
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext] | None = None,
) -> torch.Tensor:  # [R] int64
    """The (penalised) argmax of every row: what a greedy row of `process_logits` is a one-hot
    of, without building the [R, V] distribution."""
    if contexts is not None and any(p.has_penalties for p in params):
        logits = logits.float().clone()
        apply_penalties(logits, params, contexts)
    return argmax_rows(logits)


class TokenPieces:
    """Each token's text as bytes, decoded on first use (for the infill sampler), and the
    model's end-of-sequence ids."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        self.tok = tokenizer
        self.eos = frozenset(eos_ids)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self.tok.decode([token_id]).encode()
        return b


def infill_filter(p: torch.Tensor, eog: frozenset[int], pieces: TokenPieces) -> torch.Tensor:
    """llama.cpp's `infill` sampler on one row's probabilities [V] (zero: filtered out):
    - if the end tokens hold enough mass (3 * p_end * n_candidates > p_text), only they stay;
    - else a candidate whose text begins another's takes the other's mass, or gives it up,
      whichever of the two is less likely (candidates visited most likely first);
    - text candidates under 0.2 go (no text left: the first end token alone), then, after
      renormalising, those under 1 / (n_text + 1)."""
    cand = torch.nonzero(p > 0).flatten()
    if len(cand) > 256:  # the rest hold too little mass to survive the 0.2 floor
        cand = cand[p[cand].topk(256).indices]
    order = cand[p[cand].argsort(descending=True)].tolist()
    probs = dict(zip(order, p[order].tolist()))
    is_end = {t: t in eog for t in order}
    p_end = sum(v for t, v in probs.items() if is_end[t])
    out = torch.zeros_like(p)
    if 3 * p_end * len(order) > sum(probs.values()) - p_end:
        ends = [t for t in order if is_end[t]]
        out[ends] = torch.tensor([probs[t] for t in ends]) / p_end
        return out
    alive = dict.fromkeys(order, True)
    for a in order:
        for b in order:
            if not alive[a]:
                break
            if a == b or not alive[b]:
                continue
            pa, pb = pieces(a), pieces(b)
            if pa and len(pa) <= len(pb) and pb.startswith(pa):
                dst, src = (b, a) if probs[b] > probs[a] else (a, b)
                probs[dst] += probs[src]
                probs[src], alive[src] = 0.0, False
    kept = [t for t in order if alive[t] and (is_end[t] or probs[t] >= 0.2)]
    n_text = sum(1 for t in kept if not is_end[t])
    if n_text == 0:
        out[min(eog)] = 1.0
        return out
    total = sum(probs[t] for t in kept)
    kept = [t for t in kept if is_end[t] or probs[t] / total >= 1.0 / (n_text + 1)]
    total = sum(probs[t] for t in kept)
    out[kept] = torch.tensor([probs[t] / total for t in kept], dtype=p.dtype)
    return out


def process_logits(
    logits: torch.Tensor,  # [R, V] float32 raw
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext] | None = None,
    pieces: TokenPieces | None = None,  # for `infill` rows; None: the sampler is skipped
) -> torch.Tensor:  # [R, V] float32 probabilities
    logits = logits.float()  # never modified in place unless it is a penalised copy
    if contexts is not None and any(p.has_penalties for p in params):
        logits = logits.clone()
        apply_penalties(logits, params, contexts)
    dev = logits.device
    if all(p.greedy for p in params):  # the common case: no softmax or sort
        return torch.zeros_like(logits).scatter_(1, argmax_rows(logits)[:, None], 1.0)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    late = [p.temperature_last for p in params]
    logits = logits / host_to_device([1.0 if last else t for t, last in zip(temps, late)],
                                     torch.float32, dev)[:, None]
    needs_topk = any(0 < p.top_k < logits.shape[1] for p in params)
    needs_topp = any(p.top_p < 1.0 for p in params)
    if needs_topk or needs_topp:
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = host_to_device([p.min_p for p in params], torch.float32, dev)
        cutoff = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = torch.where(probs < cutoff, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(t != 1.0 and last for t, last in zip(temps, late)):
        # p ** (1 / T), renormalised, is the softmax of logits / T over the kept tokens.
        inv = host_to_device([1.0 / t if last else 1.0 for t, last in zip(temps, late)],
                             torch.float32, dev)
        probs = probs.pow(inv[:, None])
        probs = probs / probs.sum(dim=-1, keepdim=True)
    rows = [i for i, p in enumerate(params) if p.infill and not p.greedy] if pieces else []
    if rows:
        # A host algorithm over each row's candidates: on a GPU this waits for the device
        # (sampled infill rows only; greedy rows and every other sampler stay on the device).
        host = probs[rows].cpu()
        done = [infill_filter(host[j], pieces.eos | frozenset(params[i].stop_token_ids),
                              pieces) for j, i in enumerate(rows)]
        probs = probs.clone()
        probs[rows] = torch.stack(done).to(probs.device)
    if any(p.greedy for p in params):  # decided on the host: no device synchronisation
        greedy = host_to_device([p.greedy for p in params], torch.bool, dev)
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = host_to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                        torch.long, dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= ks[:, None]
    top_p = host_to_device([p.top_p for p in params], torch.float32, dev)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def logprobs_of(
    logits: torch.Tensor,  # [R, V] raw
    chosen: torch.Tensor,  # [R] int64
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [R], [R, n], [R, n]
    """Log-probabilities of the model's raw distribution (before sampling transforms)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(max(top_n, 1), dim=-1)
    return lp.gather(1, chosen[:, None]).squeeze(1), top.values, top.indices
