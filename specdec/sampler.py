"""Logits processing shared by plain decoding, verification and draft models.

`process_logits` turns raw logits into the distribution a request samples from: penalties,
temperature, then top-k, top-p and min-p filtering. Greedy rows (temperature 0) come back as a
one-hot of their (penalised) argmax, so acceptance needs no separate greedy path.
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
    (specdec/overlap.py)."""
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


def process_logits(
    logits: torch.Tensor,  # [R, V] float32 raw
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext] | None = None,
) -> torch.Tensor:  # [R, V] float32 probabilities
    logits = logits.float()  # never modified in place unless it is a penalised copy
    if contexts is not None and any(p.has_penalties for p in params):
        logits = logits.clone()
        apply_penalties(logits, params, contexts)
    dev = logits.device
    if all(p.greedy for p in params):  # the common case: no softmax or sort
        return torch.zeros_like(logits).scatter_(1, argmax_rows(logits)[:, None], 1.0)
    temps = host_to_device([p.temperature if p.temperature > 0 else 1.0 for p in params],
                           torch.float32, dev)
    logits = logits / temps[:, None]
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
