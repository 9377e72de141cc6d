"""Training of a tiny DeepSeek-V3 with its multi-token-prediction layer through moeinfra's own
DualPipeV (``moeinfra train``): :class:`TrainConfig`, :func:`train`."""

from moeinfra.train.loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
