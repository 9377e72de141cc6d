"""The LM head: final hidden states ``[N, H]`` -> float32 logits ``[N, vocab]``.

The one GEMM of a step that reads a large weight whatever the batch (``[vocab, H]``: 132 MB for a
256-wide model with DeepSeek-V3's 129,280 tokens in float32), so it goes through
:func:`moeinfra.moe.layers.linear` (oneDNN on the CPU in float32).
"""

from __future__ import annotations

import torch
from torch import nn

from moeinfra.moe.layers import linear


class LMHead(nn.Module):
    """``weight [vocab, H]``; ``forward(hidden [N, H]) -> float32 logits [N, vocab]``."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight).float()
