"""Where a rank runs and in which dtype: the engine's ``device`` and ``dtype`` options resolved.

``device``: ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda`` (a unit's rank ``r`` on
this host on GPU ``r`` modulo the GPUs the process sees, as ``torchrun``'s ``LOCAL_RANK``: give each
unit its own GPUs with ``CUDA_VISIBLE_DEVICES``) or ``cuda:N``. ``dtype``: ``auto`` is bfloat16 on a GPU and float32 on the
CPU (where float32 is the tested, exact path). A unit's collectives use NCCL on CUDA and gloo on
the CPU.
"""

from __future__ import annotations

import torch

from moeinfra.errors import InputError


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The ``torch.device`` of engine option ``device=name`` for the process of ``local_rank``
    (None: this process's current CUDA device, which a unit's launcher sets per rank)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError(f"device={name!r}: torch sees no CUDA GPU here; use device='cpu'")
    count = torch.cuda.device_count()
    if name == "cuda":
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", local_rank % count)
    index = int(name.split(":")[1])
    if index >= count:
        raise InputError(f"device={name!r}: this process sees {count} GPU(s), cuda:0..{count - 1}")
    return torch.device("cuda", index)


def place_rank(name: str, local_rank: int | None = None) -> torch.device:
    """:func:`resolve_device`, made this process's current CUDA device when it is one (where NCCL
    and every kernel without an explicit device run)."""
    device = resolve_device(name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Weights' and cache's dtype of engine option ``dtype=name`` on ``device``."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def collective_backend(device: torch.device) -> str:
    """``nccl`` for a unit on GPUs, ``gloo`` on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def keeps_fp8(option: str, device: torch.device) -> bool:
    """Engine option ``fp8_weights`` resolved: whether FP8 projections stay FP8 on ``device``."""
    if option != "auto":
        return option == "keep"
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
