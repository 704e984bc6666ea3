"""Target hidden states for drafters that consume them (`Drafter.needs_hidden_states`: EAGLE):
which layers a step captures, and each drafter's share of them, after prefill chunks here and
after verification in step_results.finish_step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.scheduler import StepPlan
    from specdec.sequence import Sequence


def wants_features(engine: LLMEngine, seq: Sequence) -> bool:
    return seq.spec_method != "none" and engine._drafter_of(seq).needs_hidden_states


def capture_layers(engine: LLMEngine, plan: StepPlan) -> tuple[int, ...] | None:
    """Union of target layers that this step's drafters need features from; None when no
    drafter in the step consumes target features."""
    layers: set[int] | None = None
    for seq in [p.seq for p in plan.prefills] + [d.seq for d in plan.decodes]:
        if wants_features(engine, seq):
            layers = (layers or set()) | set(engine._drafter_of(seq).capture_layers)
    return None if layers is None else tuple(sorted(layers))


def features_for(engine: LLMEngine, out, capture: tuple[int, ...], seq: Sequence,
                 rows: torch.Tensor) -> torch.Tensor:
    """The features a drafter asked for, in its capture_layers order, at the given rows."""
    d = engine._drafter_of(seq)
    hid = out.features.shape[1] // (len(capture) + 1)
    cols = [capture.index(layer) for layer in d.capture_layers] + [len(capture)]
    blocks = [out.features[rows, c * hid:(c + 1) * hid] for c in cols]
    return torch.cat(blocks, dim=-1)


def observe_prefills(engine: LLMEngine, plan: StepPlan, out, capture: tuple[int, ...]
                     ) -> None:
    """Hand each prefill chunk's features (the step captured layers `capture`) to its drafter."""
    for i, p in enumerate(plan.prefills):
        if wants_features(engine, p.seq):
            c = p.seq.num_computed
            rows = torch.arange(out.query_offsets[i], out.query_offsets[i] + p.num_tokens,
                                device=out.features.device)
            engine._drafter_of(p.seq).observe(p.seq.request_id, c,
                                              p.seq.tokens[c:c + p.num_tokens],
                                              features_for(engine, out, capture, p.seq, rows))
