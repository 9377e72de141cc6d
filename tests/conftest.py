"""Suite-wide pytest hooks."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    """The docs blocks (one module, about a third of the suite's time) run first: under
    ``make test``'s two xdist workers a module stays on one worker, and a long module handed out
    last would leave the other worker idle while it runs."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_docs.py")


@pytest.fixture
def avx2_only(monkeypatch):
    """This process as on a CPU with AVX2 only: :mod:`moeinfra.moe.cpu_features` reports no
    oneDNN half precision, and oneDNN's half-precision packing and matmul fail as they do there
    ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")."""
    import torch

    from moeinfra.moe import cpu_features, layers

    monkeypatch.setattr(cpu_features, "detect", lambda: cpu_features.AVX2_ONLY)
    half = (torch.bfloat16, torch.float16)

    def refusing(op):
        def call(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.dtype in half for a in args):
                raise RuntimeError(f"{op}: bf16 path needs the cpu support avx_ne_convert or ...")
            return original[op](*args, **kwargs)

        return call

    original = {
        "_reorder_linear_weight": torch.ops.mkldnn._reorder_linear_weight,
        "_matmul": layers._matmul,
    }
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", refusing("_reorder_linear_weight")
    )
    monkeypatch.setattr(layers, "_matmul", refusing("_matmul"))
    return cpu_features.AVX2_ONLY
