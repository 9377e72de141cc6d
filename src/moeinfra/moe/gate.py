"""DeepSeek-V3 routing: sigmoid scores, selection bias, group-limited top-k, normalised scaled weights."""

from __future__ import annotations

import torch
from torch import nn

from moeinfra.errors import InputError
from moeinfra.moe import cpu_kernels
from moeinfra.moe.config import MoEConfig

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")


def expert_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """``[T, E]`` affinity of each token to each expert: ``sigmoid`` (DeepSeek-V3), ``softmax``
    (DeepSeek-V2) or ``sqrtsoftplus`` (DeepSeek-V4: ``sqrt(softplus(logits))``)."""
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "softmax":
        return logits.softmax(dim=-1, dtype=torch.float32).to(logits.dtype)
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise InputError(f"scoring={scoring!r} is not allowed; use one of {', '.join(SCORINGS)}")


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    num_groups: int,
    groups_per_token: int,
    scaling_factor: float,
    scoring: str = "sigmoid",
    normalize: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token and their weights, by the rules of DeepSeek-V3's reference
    gate (``inference/model.py``).

    Scores are ``sigmoid(logits)`` (or softmax). The per-expert ``bias`` is added for *selection
    only* (auxiliary-loss-free balancing). Groups are ranked by the sum of their two best biased
    scores, or by their best score when there is no bias (DeepSeek-V2's rule); the best
    ``groups_per_token`` groups are kept, and the ``top_k`` best biased scores inside them are
    chosen. Weights are the *unbiased* scores of the chosen experts, normalised to sum to 1 when
    ``normalize`` (default: with sigmoid scores only, as the reference; ``transformers``' config
    sets it with ``norm_topk_prob``; 1e-20 is added to the sum, as ``transformers`` does, so that
    scores that all underflow give weights of 0, not NaN) and multiplied by ``scaling_factor``.

    Args:
        logits: ``[T, E]`` gate logits. bias: ``[E]`` or None.
    Returns:
        ``(weights [T, top_k] float, indices [T, top_k] int64)``, indices ordered by biased score.
    """
    num_tokens, num_experts = logits.shape
    if num_experts % num_groups:
        raise InputError(f"num_groups={num_groups} must divide the {num_experts} experts")
    if normalize is None:
        normalize = scoring == "sigmoid"
    # DeepSeek-V3's sigmoid routing on the CPU: moeinfra's kernel, the ~20 operators in one (6 vs
    # 24 us for one token of 32 or 256 experts, 4.8 vs 12.3 ms for 4,096 tokens of 256; 2 threads);
    # equal biased scores are ordered by expert index
    if (
        scoring == "sigmoid"
        and logits.dtype == torch.float32
        and cpu_kernels.usable(logits, *(() if bias is None else (bias,)))
    ):
        return torch.ops.moeinfra.route(
            logits,
            bias,
            top_k,
            num_groups,
            groups_per_token,
            scaling_factor,
            normalize,
        )
    scores = expert_scores(logits, scoring)
    original = scores
    if bias is not None:
        scores = scores + bias
    if num_groups > 1:
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        if bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        best = group_scores.topk(groups_per_token, dim=-1)[1]
        drop = torch.ones(num_tokens, num_groups, dtype=torch.bool, device=logits.device)
        drop.scatter_(1, best, False)
        scores = grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
    indices = scores.topk(top_k, dim=-1)[1]
    weights = original.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, indices


class Gate(nn.Module):
    """The MoE router of DeepSeek-V3.

    Parameters: ``weight [E, H]``; buffer ``bias [E]`` (the selection bias, updated by the
    auxiliary-loss-free balancing outside the gradient; zero at start).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_routed_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.hidden_size**-0.5)
        self.register_buffer("bias", torch.zeros(config.num_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k], indices [T, k])`` (see :func:`route`).

        Logits, scores and weights are float32 whatever the model's dtype (as DeepSeek-V3's
        reference in ``transformers`` computes them)."""
        c = self.config
        return route(
            x.float() @ self.weight.float().t(),
            self.bias.float(),
            top_k=c.experts_per_token,
            num_groups=c.num_expert_groups,
            groups_per_token=c.groups_per_token,
            scaling_factor=c.routed_scaling_factor,
            scoring=c.scoring,
            normalize=c.norm_topk_prob,
        )
