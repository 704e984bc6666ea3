"""Int8 storage of an EAGLE head's Linear weights, for shipping a head within the repo's size
limit (a float16 head for a 1.5B target is ~140 MB; int8 halves it).

A weight w [N, K] is stored under its own name as int8 q [N, K], and under `<name>_scale` as
float16 s [N, G], G = K / group_size (G = 1: one scale per output row):
    w[n, g*group_size + j] ~= q[n, g*group_size + j] * s[n, g],  q in [-127, 127],
symmetric, s = max |w| of the group / 127. The head's config.json records it under QUANT_KEY:
    {"method": "int8", "group_size": 0 (per row) or g, "weights": [the names stored so]}.
Loading dequantizes to float, or, next to a target whose weights stay quantized on the CPU,
keeps them int8 (`quant_linear`): the CPU's int8 kernels (specdec/models/quant_linear.py, kind
"q8") hold exactly these values with the scale repeated over each group of 32 columns, so a head
step reads a byte a weight instead of four.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.models.quant_linear import GROUP, QuantLinear, QuantWeight

QUANT_KEY = "specdec_quantization"
SCALE_SUFFIX = "_scale"
METHODS = ("int8",)


def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> q [N, K] int8, scales [N, G] float16 (group_size 0: G = 1)."""
    n, k = w.shape
    g = group_size or k
    if k % g:
        raise ValueError(f"group_size {group_size} does not divide the weight's {k} columns")
    wg = w.detach().float().reshape(n, k // g, g)  # [N, G, g]
    # Round with the float16 scale that is stored, so dequantizing reproduces the rounding.
    scale = (wg.abs().amax(-1) / 127).to(torch.float16)  # [N, G]
    s = scale.float().unsqueeze(-1)  # [N, G, 1]
    q = torch.where(s > 0, wg / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return q.round().clamp(-127, 127).to(torch.int8).reshape(n, k), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8, scale [N, G] -> w [N, K] float32."""
    n, k = q.shape
    g = scale.shape[1]
    return (q.float().reshape(n, g, k // g) * scale.float().unsqueeze(-1)).reshape(n, k)


def quant_linear(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> QuantLinear | None:
    """q [N, K] int8 and scale [N, G] as a QuantLinear of kind "q8" with the same weights (no
    rounding: a scale per row or per group of a multiple of 32 columns is a scale per group of
    32); None where K or the group size is not a multiple of 32."""
    n, k = q.shape
    if k % GROUP or (k // scale.shape[1]) % GROUP:
        return None
    d = scale.float().repeat_interleave(k // scale.shape[1] // GROUP, dim=1)  # [N, K / 32]
    return QuantLinear([QuantWeight.pack("q8", q, d, None)], bias)


def quantize_state(sd: dict[str, torch.Tensor], names: list[str], group_size: int = 0
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A state dict with `names` (2-D weights) stored as int8 and scales, and the config entry
    that says so."""
    out = dict(sd)
    for name in names:
        out[name], out[name + SCALE_SUFFIX] = quantize_int8(sd[name], group_size)
    return out, {"method": "int8", "group_size": group_size, "weights": list(names)}


def dequantize_state(sd: dict[str, torch.Tensor], qcfg: dict[str, Any]
                     ) -> dict[str, torch.Tensor]:
    """The inverse of quantize_state: float32 weights in place of int8 ones and their scales."""
    if qcfg.get("method") not in METHODS:
        raise ValueError(f"unknown head quantization {qcfg.get('method')!r}; "
                         f"known: {', '.join(METHODS)}")
    out = dict(sd)
    for name in qcfg["weights"]:
        if name not in sd or name + SCALE_SUFFIX not in sd or sd[name].dtype != torch.int8:
            raise ValueError(f"quantized head: {name} is not stored as int8 with "
                             f"{name}{SCALE_SUFFIX}")
        out[name] = dequantize_int8(sd[name], out.pop(name + SCALE_SUFFIX))
    return out
