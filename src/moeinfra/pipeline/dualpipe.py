"""DeepSeek's ``dualpipe`` names, for scripts written against its package: change
``from dualpipe import ...`` / ``from dualpipe.utils import ...`` to
``from moeinfra.pipeline.dualpipe import ...`` (and use gloo/CPU where a script hard-codes NCCL/CUDA).

Imports torch (the rest of :mod:`moeinfra.pipeline` does not).
"""

from moeinfra.pipeline.runtime import (
    DualPipe,
    DualPipeV,
    run_backward,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
)

__all__ = [
    "DualPipe",
    "DualPipeV",
    "run_backward",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
]
