"""Speculative decoding: checking a request's draft tokens in one target step.

A decode step of a request with ``k`` drafts ``d_1 .. d_k`` (proposed by DeepSeek's MTP layer,
:mod:`.models.mtp`) runs the target on its last token and the drafts — ``k + 1`` positions — and gets
``k + 1`` target distributions ``p_0 .. p_k`` (``p_j`` predicts the token after ``d_j``).
:func:`verify` then accepts a prefix of the drafts and adds one token of its own:

* greedy requests accept ``d_{j+1}`` while it is ``argmax p_j``; the first disagreement (or, all
  accepted, ``argmax p_k``) is the bonus token — the tokens greedy decoding without drafts makes;
* sampled requests use vLLM's rejection sampling for drafts proposed greedily (a draft distribution
  that is one-hot at ``d``): accept ``d_{j+1}`` with probability ``p_j(d_{j+1})``; on a rejection draw
  from ``p_j`` with ``d_{j+1}`` removed (renormalised); all accepted, draw the bonus from ``p_k``. Each
  emitted token then follows the target distribution exactly, as without drafts.

:class:`SpecStats` counts drafts and acceptances per position, as vLLM's
``spec_decode_num_draft_tokens`` / ``..._num_accepted_tokens`` / ``..._per_pos`` metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from moeinfra.engine.params import SamplingParams
from moeinfra.engine.sampling import probabilities, step_generator
from moeinfra.errors import InputError


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    step: int,
) -> list[int]:
    """Tokens a request emits this step: the accepted drafts, then one token of the target's.

    ``logits [k + 1, V]``: the target's float32 logits at the last token and at each draft;
    ``drafts``: the ``k`` draft tokens; ``step``: tokens the request generated before (seeds its
    draws, as :func:`~moeinfra.engine.sampling.sample` does). Returns 1 to ``k + 1`` tokens.
    """
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise InputError(f"logits has {logits.shape[0]} rows, {k} drafts need {k + 1}")
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == target[accepted]:
            accepted += 1
        return [*drafts[:accepted], target[accepted]]
    probs = probabilities(logits, [params] * (k + 1))
    gen = step_generator(params, generator, step)
    coins = torch.rand(k + 1, generator=gen, device=probs.device)
    for j, draft in enumerate(drafts):
        if coins[j] < probs[j, draft]:
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        token = torch.multinomial(residual, 1, generator=gen)
        return [*drafts[:j], int(token)]
    return [*drafts, int(torch.multinomial(probs[k], 1, generator=gen))]


@dataclass
class SpecStats:
    """Drafts proposed and accepted, in all and per draft position (``per_position[j]``: drafts
    at position ``j + 1`` accepted)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verification rounds that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_position: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.per_position is None:
            self.per_position = np.zeros(self.num_speculative_tokens, dtype=np.int64)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.per_position[:accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification round: 1 + accepted drafts (vLLM's acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
