"""EAGLE draft heads and their published checkpoint layouts.

EAGLE-1/2 (one decoder layer, the target's LM head):
    config.json   an HF Llama config of the target's sizes with num_hidden_layers 1
    fc.weight [H, 2H], fc.bias [H]      fuses cat(embedding of the next token, target feature)
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight   (layer 0 has no input norm: fc feeds it)
    The feature is the target's final normed hidden state; the head predicts the next one and
    the target's LM head turns it into draft logits.

EAGLE-3 (architectures ["LlamaForCausalLMEagle3"]):
    fc.weight [H, 3H]                   fuses the residual streams of a low, middle, high layer
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H] (input: cat(normed embedding, normed feature))
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight [H], lm_head.weight [draft_vocab, H]
    d2t [draft_vocab] int64: target id = draft id + d2t[draft id];  t2d [vocab] bool
    (t2d marks exactly the target ids some draft id maps to; load_head checks it)
Embeddings come from the target (a checkpoint's own embed_tokens.weight is ignored).
A head saved with `quantize="int8"` holds its Linear weights as int8 with float16 scales
(drafters/eagle_quant.py) and says so in config.json; load_head dequantizes it, or keeps it int8
on the CPU's quantized kernels where the target runs on them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.eagle_quant import (
    QUANT_KEY,
    SCALE_SUFFIX,
    dequantize_state,
    quant_linear,
    quantize_state,
)
from specdec.models.llama import RMSNorm
from specdec.models.rope import RotaryEmbedding

EAGLE3_ARCH = "LlamaForCausalLMEagle3"


class HeadAttention(nn.Module):
    """Attention over an explicit key/value list and mask: the head's KV is small and private."""

    def __init__(self, hf: dict[str, Any], in_dim: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        self.heads = int(hf["num_attention_heads"])
        self.kv_heads = int(hf.get("num_key_value_heads") or self.heads)
        self.head_dim = int(hf.get("head_dim") or hidden // self.heads)
        bias = bool(hf.get("attention_bias", False))
        self.q_proj = nn.Linear(in_dim, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,  # [..., T, in_dim]
        positions: torch.Tensor,  # [T] int64
        past: tuple[torch.Tensor, torch.Tensor] | None,  # ([..., S, Hkv, D], same)
        mask: torch.Tensor,  # [T, S + T] bool, True = may attend
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out [..., T, H], new k, new v
        lead, t = x.shape[:-2], x.shape[-2]
        q = self.q_proj(x).view(*lead, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(*lead, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, t, self.kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, 1, rot]
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], -3),
                                                    torch.cat([past[1], v], -3))
        rep = self.heads // self.kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(-2, -3),  # [..., Hq, T, D]
            keys.repeat_interleave(rep, dim=-2).transpose(-2, -3),  # [..., Hq, S + T, D]
            values.repeat_interleave(rep, dim=-2).transpose(-2, -3),
            attn_mask=mask)
        o = o.transpose(-2, -3).reshape(*lead, t, self.heads * self.head_dim)
        return self.o_proj(o), k, v


class HeadMLP(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    """EAGLE-1/2's layer 0 (no input norm) or EAGLE-3's midlayer (normed embedding and feature,
    concatenated, feed attention; the feature is the residual)."""

    def __init__(self, hf: dict[str, Any], eagle3: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.eagle3 = eagle3
        if eagle3:
            self.input_layernorm = RMSNorm(hidden, eps)
            self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = HeadAttention(hf, 2 * hidden if eagle3 else hidden, rotary)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = HeadMLP(hf)

    def forward(self, h: torch.Tensor, emb: torch.Tensor | None, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor):
        residual = h  # [..., T, H]
        x = (torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)  # [..., T, 2H]
             if self.eagle3 else h)
        a, k, v = self.self_attn(x, positions, past, mask)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


class EagleHead(nn.Module):
    """One EAGLE head. `step` runs the layer on T inputs of one sequence (or a batch of
    sequences in training) and returns the predicted next features and the new KV entries."""

    def __init__(self, hf: dict[str, Any], target_hidden: int | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.eagle3 = EAGLE3_ARCH in (hf.get("architectures") or [])
        hidden = int(hf["hidden_size"])
        th = int(target_hidden or hf.get("target_hidden_size") or hidden)
        head_dim = int(hf.get("head_dim") or hidden // int(hf["num_attention_heads"]))
        self.rotary = RotaryEmbedding(head_dim, hf)
        if self.eagle3:
            self.fc = nn.Linear(3 * th, hidden, bias=False)
            self.midlayer = HeadLayer(hf, True, self.rotary)
            self.norm = RMSNorm(hidden, float(hf.get("rms_norm_eps", 1e-6)))
            dv = int(hf.get("draft_vocab_size") or hf["vocab_size"])
            self.lm_head = nn.Linear(hidden, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(int(hf["vocab_size"]), dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=bool(hf.get("bias", True)))
            self.layers = nn.ModuleList([HeadLayer(hf, False, self.rotary)])

    def capture_layers(self, target_layers: int) -> tuple[int, ...]:
        """Target layers whose residual streams EAGLE-3 fuses (after layers 1, L/2 - 1, L - 4,
        the published choice), or the ones its config names."""
        if not self.eagle3:
            return ()
        ids = (self.hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            ids = (1, target_layers // 2 - 1, target_layers - 4)
        # Tiny targets: clamp into range (a layer may then appear twice, which is fine).
        return tuple(min(max(int(i), 0), target_layers - 1) for i in ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (as the engine delivers them) -> the head's input feature [.., H]."""
        if self.eagle3:  # the three captured layers; the final normed state is not used
            return self.fc(features[..., :self.fc.in_features])  # [..., 3H] -> [..., H]
        return features

    def step(
        self,
        feat: torch.Tensor,  # [..., T, H] fused target feature or the head's own prediction
        emb: torch.Tensor,  # [..., T, H] embedding of the token after each feature's position
        positions: torch.Tensor,  # [T] int64
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,  # [T, S + T] bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # h [..., T, H], k, v
        if self.eagle3:
            return self.midlayer(feat, emb, positions, past, mask)
        return self.layers[0](self.fc(torch.cat([emb, feat], -1)), None, positions, past, mask)

    def logits(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """[n, H] predicted features -> [n, vocab] float32 logits over the target vocabulary
        (tokens outside an EAGLE-3 draft vocabulary get -inf)."""
        if not self.eagle3:
            return target_lm_head(h).float()
        dl = self.lm_head(self.norm(h)).float()  # [n, draft_vocab]
        out = dl.new_full((h.shape[0], self.t2d.numel()), float("-inf"))
        out[:, torch.arange(dl.shape[1], device=dl.device) + self.d2t] = dl
        return out

    def greedy(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """[n, H] -> [n] the target ids `logits(h).argmax(-1)` names, without the full-vocabulary
        logits (draft ids are in target-id order, so the first maximum is the same)."""
        if not self.eagle3:
            return target_lm_head(h).argmax(-1)
        return draft_to_target(self, self.lm_head(self.norm(h)).argmax(-1))


def load_head(path: str | Path, target_hidden: int | None = None,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              int8_kernels: bool = False) -> EagleHead:
    """Build a head from a directory with config.json and model.safetensors (or the
    pytorch_model.bin of the EAGLE-1 releases); shapes are checked name by name, and an EAGLE-3
    draft vocabulary must map one-to-one. An int8 head is dequantized, or with `int8_kernels`
    (float32 on the CPU only) its Linear layers stay int8 on the CPU's quantized kernels."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    qcfg = hf.pop(QUANT_KEY, None)  # the built head is a float head
    head = EagleHead(hf, target_hidden)
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        sd = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or pytorch_model.bin")
    sd = {k.removeprefix("model."): v for k, v in sd.items() if k != "embed_tokens.weight"}
    if qcfg and int8_kernels and torch.device(device).type == "cpu" and dtype == torch.float32:
        kept = _keep_int8(head, sd, qcfg, str(path))
        qcfg = {**qcfg, "weights": [n for n in qcfg["weights"] if n not in kept]}
    if qcfg:
        sd = dequantize_state(sd, qcfg)
    own = head.state_dict()
    missing = sorted(set(own) - set(sd))
    unknown = sorted(set(sd) - set(own))
    if missing or unknown:
        raise ValueError(f"EAGLE head {path}: missing weights {missing}, unknown {unknown}")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"EAGLE head {path}: {name} has shape {tuple(t.shape)}, "
                             f"expected {tuple(own[name].shape)}")
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()})
    if head.eagle3:
        check_draft_vocab(head, str(path))
    return head.to(device=device, dtype=dtype).eval()


def _keep_int8(head: EagleHead, sd: dict[str, torch.Tensor], qcfg: dict[str, Any], where: str
               ) -> set[str]:
    """Put QuantLinears in place of the head's Linears whose int8 weights the CPU kernels take
    as stored; their entries leave `sd`. The names of the weights so kept."""
    kept = set()
    for name in qcfg.get("weights", []):
        module = name.removesuffix(".weight")
        lin = head.get_submodule(module)
        q, scale = sd.get(name), sd.get(name + SCALE_SUFFIX)
        if not isinstance(lin, nn.Linear) or q is None or scale is None or q.dtype != torch.int8:
            continue  # dequantize_state says what is wrong
        if tuple(q.shape) != tuple(lin.weight.shape):
            raise ValueError(f"EAGLE head {where}: {name} has shape {tuple(q.shape)}, "
                             f"expected {tuple(lin.weight.shape)}")
        bias = sd.get(module + ".bias") if lin.bias is not None else None
        layer = quant_linear(q, scale, None if bias is None else bias.float())
        if layer is None or (lin.bias is not None and bias is None):
            continue
        parent, _, leaf = module.rpartition(".")
        setattr(head.get_submodule(parent) if parent else head, leaf, layer)
        for key in (name, name + SCALE_SUFFIX, module + ".bias"):
            sd.pop(key, None)
        kept.add(name)
    return kept


def linear_weights(head: EagleHead) -> list[str]:
    """State-dict names of the head's Linear weights: what int8 storage quantizes."""
    return [f"{n}.weight" for n, m in head.named_modules() if isinstance(m, nn.Linear)]


def save_head(head: EagleHead, path: str | Path, dtype: torch.dtype = torch.float32,
              quantize: str | None = None, group_size: int = 0) -> None:
    """Write config.json and model.safetensors in the published layout. quantize="int8"
    stores the Linear weights as int8 with float16 scales per output row (group_size 0) or per
    group of group_size columns, everything else in float16; other servers cannot read that.
    Written under temporary names and renamed: a killed run leaves the previous head."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = dict(head.hf)
    sd = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if quantize:
        if quantize != "int8":
            raise ValueError(f"quantize must be 'int8' or None, got {quantize!r}")
        dtype = torch.float16
        sd, hf[QUANT_KEY] = quantize_state(sd, linear_weights(head), group_size)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(sd, str(path / "model.safetensors.tmp"))
    (path / "model.safetensors.tmp").chmod(0o644)  # safetensors writes owner-only files
    (path / "config.json.tmp").write_text(json.dumps(hf, indent=2))
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    os.replace(path / "config.json.tmp", path / "config.json")


def quantize_head(src: str | Path, dst: str | Path | None = None, group_size: int = 0) -> Path:
    """Store an existing head directory's weights as int8 (in place when dst is None)."""
    head = load_head(src)
    save_head(head, dst or src, quantize="int8", group_size=group_size)
    return Path(dst or src)


def set_draft_vocab(head: EagleHead, keep: torch.Tensor) -> None:
    """Make the target ids `keep` [draft_vocab] (distinct) the EAGLE-3 draft vocabulary; draft
    id i stands for the i-th smallest of them."""
    keep = keep.to(head.d2t.device).sort().values  # [draft_vocab]
    if keep.numel() != head.d2t.numel() or keep.unique().numel() != keep.numel():
        raise ValueError(f"a draft vocabulary needs {head.d2t.numel()} distinct target ids")
    head.d2t.copy_(keep - torch.arange(keep.numel(), device=keep.device))
    head.t2d.zero_()
    head.t2d[keep] = True


def draft_to_target(head: EagleHead, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + head.d2t[draft_ids]  # [n] target ids


def target_to_draft(head: EagleHead, target_ids: torch.Tensor) -> torch.Tensor:
    """[n] target ids -> [n] draft ids, -1 for a token outside the draft vocabulary."""
    inv = torch.full_like(head.t2d, -1, dtype=torch.long)  # [vocab]
    draft = torch.arange(head.d2t.numel(), device=head.d2t.device)
    inv[draft_to_target(head, draft)] = draft
    return inv[target_ids]


def check_draft_vocab(head: EagleHead, where: str = "EAGLE head") -> None:
    """d2t must map the draft ids to distinct in-range target ids, exactly those t2d marks."""
    targets = draft_to_target(head, torch.arange(head.d2t.numel(), device=head.d2t.device))
    ok = bool(((targets >= 0) & (targets < head.t2d.numel())).all())
    ok = ok and targets.unique().numel() == targets.numel()
    ok = ok and int(head.t2d.sum()) == targets.numel() and bool(head.t2d[targets].all())
    if not ok:
        raise ValueError(f"{where}: d2t and t2d do not describe one draft vocabulary")


def head_config(target_hf: dict[str, Any], eagle3: bool = False,
                draft_vocab_size: int | None = None) -> dict[str, Any]:
    """The config.json of a new head for a target: the target's sizes, one layer."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta",
            "rope_scaling", "rope_parameters", "hidden_act", "attention_bias")
    hf = {k: target_hf[k] for k in keys if k in target_hf}
    hf.update(num_hidden_layers=1, model_type="llama", bias=True)
    if eagle3:
        hf.update(architectures=[EAGLE3_ARCH], draft_vocab_size=draft_vocab_size
                  or target_hf["vocab_size"], target_hidden_size=target_hf["hidden_size"])
        hf.pop("bias")
    else:
        hf["architectures"] = ["LlamaForCausalLM"]
    return hf
