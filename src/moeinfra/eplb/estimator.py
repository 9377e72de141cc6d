"""``LoadEstimator``: turn per-step expert token counts into the load to balance."""

from __future__ import annotations

from typing import Any

import numpy as np

from moeinfra.eplb.inputs import to_numpy_load
from moeinfra.errors import InputError


class LoadEstimator:
    """Accumulate ``[layers, experts]`` token counts per step; :meth:`load` gives the load to balance.

    Two modes (exactly one):

    * ``window=W``: the sum of the last ``W`` steps (what vLLM's EPLB does).
    * ``ema=alpha``: exponential moving average ``m_t = alpha * x_t + (1 - alpha) * m_{t-1}``,
      bias-corrected by ``1 - (1 - alpha)^t`` so early estimates are not pulled towards zero.

    Counts may be numpy arrays or torch tensors (any device); the estimate is numpy float64.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        window: int | None = None,
        ema: float | None = None,
    ) -> None:
        if num_layers <= 0 or num_experts <= 0:
            raise InputError(
                f"num_layers={num_layers} and num_experts={num_experts} must be positive"
            )
        if (window is None) == (ema is None):
            raise InputError("give exactly one of window=<steps> or ema=<alpha>")
        if window is not None and window <= 0:
            raise InputError(f"window={window} must be a positive number of steps")
        if ema is not None and not 0.0 < ema <= 1.0:
            raise InputError(f"ema={ema} must be in (0, 1]")
        self.shape = (num_layers, num_experts)
        self.window = window
        self.alpha = ema
        self.steps = 0
        self._history = np.zeros((window or 1, *self.shape)) if window else None
        self._sum = np.zeros(self.shape)

    def record(self, counts: Any) -> None:
        """Add one step's token counts ``[layers, experts]``."""
        step = to_numpy_load(counts, "counts")
        if step.shape != self.shape:
            raise InputError(f"counts shape {step.shape} must be [layers, experts] = {self.shape}")
        if self._history is not None:
            slot = self.steps % self.window
            self._sum += step - self._history[slot]
            self._history[slot] = step
        else:
            self._sum = self.alpha * step + (1.0 - self.alpha) * self._sum
        self.steps += 1

    def load(self) -> np.ndarray:
        """``[layers, experts]`` load estimate (window sum, or bias-corrected EMA); zeros before any step."""
        if self.steps == 0:
            return np.zeros(self.shape)
        if self._history is not None:
            # Recompute from the buffer now and then would avoid drift; sums of counts stay exact in float64.
            return np.maximum(self._sum, 0.0)
        return self._sum / (1.0 - (1.0 - self.alpha) ** self.steps)

    def reset(self) -> None:
        """Forget every recorded step."""
        self.steps = 0
        self._sum = np.zeros(self.shape)
        if self._history is not None:
            self._history[:] = 0.0
