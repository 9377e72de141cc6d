"""torch.distributed runtime: one executor for any Schedule, and DeepSeek-style runners.

This is the only part of :mod:`moeinfra.pipeline` that imports torch.
"""

from moeinfra.pipeline.runtime.executor import ScheduleExecutor, TensorSpec, run_backward
from moeinfra.pipeline.runtime.models import (
    ZB1P,
    DualPipe,
    DualPipeV,
    GPipe,
    OneFOneB,
    gather,
    scatter,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
)
from moeinfra.pipeline.runtime.weight_grad import WeightGradStore

__all__ = [
    "ZB1P",
    "DualPipe",
    "DualPipeV",
    "GPipe",
    "OneFOneB",
    "ScheduleExecutor",
    "TensorSpec",
    "WeightGradStore",
    "gather",
    "run_backward",
    "scatter",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
]
