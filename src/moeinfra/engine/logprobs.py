"""Log-probabilities a request asked for (``SamplingParams.logprobs`` / ``prompt_logprobs``): the
log-softmax of the model's raw logits, before any processing or temperature (vLLM's default
``raw_logprobs``), at the chosen token and at the most likely ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeinfra.engine.outputs import Logprobs


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 log-probabilities of ``[R, V]`` logits (a new tensor)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather(logprobs: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[Logprobs]:
    """One :class:`Logprobs` per row of ``logprobs [R, V]``: of ``tokens[r]`` (with its rank, 1 =
    most likely, ties counted against it, as vLLM counts) and of the ``top_n[r]`` most likely
    tokens, most likely first."""
    if not len(tokens):
        return []
    index = torch.tensor(tokens, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None])
    ranks = (logprobs >= chosen).sum(dim=1).tolist()
    most = max(top_n)
    top_values, top_ids = (
        logprobs.topk(most, dim=1) if most else (logprobs[:, :0], index[:, None][:, :0])
    )
    top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
    return [
        Logprobs(tokens[r], chosen[r], ranks[r], top_ids[r][: top_n[r]], top_values[r][: top_n[r]])
        for r in range(len(tokens))
    ]
