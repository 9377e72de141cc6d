"""Read expert-load statistics from files: ``.npy``, ``.npz``, ``.pt``/``.pth``, ``.json``, ``.csv``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeinfra.eplb.inputs import to_numpy_load
from moeinfra.errors import InputError

SUFFIXES = (".npy", ".npz", ".pt", ".pth", ".json", ".csv")
_KEYS = ("load", "weight", "expert_load", "counts")


def _pick(mapping: dict, path: Path):
    for key in _KEYS:
        if key in mapping:
            return mapping[key]
    if len(mapping) == 1:
        return next(iter(mapping.values()))
    raise InputError(
        f"{path}: holds several arrays {sorted(mapping)}; name the load one of {', '.join(_KEYS)}"
    )


def read_load(path: str | Path) -> np.ndarray:
    """``[layers, experts]`` float64 load from a file.

    ``.npz``/``.pt`` dicts/``.json`` objects may hold several entries: the one named ``load``,
    ``weight``, ``expert_load`` or ``counts`` is used (or the only one). ``.json`` may also be a bare
    list of lists; ``.csv`` one row per layer.
    """
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise InputError(f"load file {str(path)!r} must end in one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise InputError(f"load file {str(path)!r} does not exist")
    try:
        if path.suffix == ".npy":
            raw = np.load(path, allow_pickle=False)
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                raw = _pick({k: data[k] for k in data.files}, path)
        elif path.suffix in (".pt", ".pth"):
            import torch

            raw = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(raw, dict):
                raw = _pick(raw, path)
        elif path.suffix == ".json":
            raw = json.loads(path.read_text())
            if isinstance(raw, dict):
                raw = _pick(raw, path)
        else:
            raw = np.loadtxt(path, delimiter=",", ndmin=2)
    except InputError:
        raise
    except Exception as exc:  # numpy, torch and json each raise their own types for a bad file
        raise InputError(f"load file {str(path)!r} cannot be read: {exc}") from None
    return to_numpy_load(raw, f"load in {path.name}")
