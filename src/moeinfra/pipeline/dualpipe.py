"""DeepSeek's ``dualpipe`` names, for scripts written against its package: change
``from dualpipe import ...`` / ``from dualpipe.utils import ...`` to
``from moeinfra.pipeline.dualpipe import ...`` (and use gloo/CPU where a script hard-codes NCCL/CUDA).

Imports torch (the rest of :mod:`moeinfra.pipeline` does not).
"""

import sys
import types

from moeinfra.pipeline import generators
from moeinfra.pipeline.runtime import (
    DualPipe,
    DualPipeV,
    WeightGradStore,
    run_backward,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
)

__all__ = [
    "DualPipe",
    "DualPipeV",
    "WeightGradStore",
    "run_backward",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
]


class _CallableModule(types.ModuleType):
    """Importing this module rebinds ``moeinfra.pipeline.dualpipe`` from the schedule generator to
    the module; called, the module is still that generator."""

    def __call__(self, *args, **kwargs):
        return generators.dualpipe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
