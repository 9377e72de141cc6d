"""A trained :class:`~moeinfra.train.model.DeepSeekForTraining` under Hugging Face's DeepSeek-V3
tensor names, the MTP layer as ``model.layers.{num_hidden_layers}.*`` with its own copies of the
shared embedding and head (as DeepSeek's checkpoints store them)."""

from __future__ import annotations

import torch

from moeinfra.engine.models.deepseek_v3 import HF_ATTENTION, HF_SWIGLU
from moeinfra.train.model import Block, DeepSeekForTraining

# the engine loader's maps, read backwards: the trainable layers have the engine's module names
_ATTENTION = {ours: hf for hf, ours in HF_ATTENTION.items()}
_SWIGLU = {
    ours.removesuffix(".weight"): hf.removesuffix(".weight") for hf, ours in HF_SWIGLU.items()
}


def _swiglu(prefix: str, ours: str, state: dict) -> dict[str, torch.Tensor]:
    return {f"{prefix}{hf}.weight": state[f"{ours}{w}.weight"] for w, hf in _SWIGLU.items()}


def _block(block: Block, prefix: str) -> dict[str, torch.Tensor]:
    state = block.state_dict()
    out = {prefix + hf: state[ours] for ours, hf in _ATTENTION.items()}
    if not hasattr(block, "moe"):
        return out | _swiglu(prefix + "mlp.", "mlp.", state)
    out[prefix + "mlp.gate.weight"] = state["moe.gate.weight"]
    out[prefix + "mlp.gate.e_score_correction_bias"] = state["moe.gate.bias"]
    if block.moe.shared is not None:
        out |= _swiglu(prefix + "mlp.shared_experts.", "moe.shared.", state)
    for e in range(len(block.moe.experts)):
        out |= _swiglu(f"{prefix}mlp.experts.{e}.", f"moe.experts.{e}.", state)
    return out


def hf_state_dict(model: DeepSeekForTraining) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` (float32, contiguous copies) under Hugging Face's names."""
    out = {"model.embed_tokens.weight": model.embed.weight}
    for i, block in enumerate(model.blocks):
        out |= _block(block, f"model.layers.{i}.")
    out["model.norm.weight"] = model.norm.weight
    out["lm_head.weight"] = model.head.weight
    mtp, prefix = model.mtp, f"model.layers.{len(model.blocks)}."
    out |= _block(mtp.block, prefix)
    out |= {
        prefix + "embed_tokens.weight": model.embed.weight,
        prefix + "enorm.weight": mtp.enorm.weight,
        prefix + "hnorm.weight": mtp.hnorm.weight,
        prefix + "eh_proj.weight": mtp.eh_proj.weight,
        prefix + "shared_head.norm.weight": mtp.norm.weight,
        prefix + "shared_head.head.weight": model.head.weight,
    }
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}
