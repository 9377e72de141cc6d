"""Option values the command groups share: durations with a unit, files and folders to read.

Each check raises :class:`~moeinfra.errors.InputError` naming the option, the value and what is
allowed; ``moeinfra.cli.main`` prints it as one line with exit code 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moeinfra.errors import InputError

#: Seconds per unit a duration option accepts.
DURATION_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}

_NUMBER = r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_DURATION = re.compile(rf"^\s*({_NUMBER})\s*({'|'.join(DURATION_UNITS)})?\s*$")


def parse_duration_s(text: str, name: str) -> float:
    """``"50ms"``, ``"0.05s"``, ``"1.5s"``, ``"200us"`` -> seconds.

    A bare number is refused (is ``--slo-tpot 50`` 50 ms or 50 s?), except 0, which needs no unit.
    Ranges (> 0, >= 0) are the caller's to check.
    """
    match = _DURATION.match(text)
    if not match:
        raise InputError(
            f"{name}={text!r} must be a duration with a unit (us, ms or s), e.g. 50ms, 0.05s, 200us"
        )
    value, unit = float(match.group(1)), match.group(2)
    if unit is None:
        if value == 0:
            return 0.0
        number = match.group(1)
        raise InputError(
            f"{name}={number} needs a unit: {number}ms or {number}s (units: us, ms, s)"
        )
    return value * DURATION_UNITS[unit]


def input_file(path: Path, name: str, allowed: str = "") -> Path:
    """``path`` if it is a file this process can read; else an error naming option ``name``:
    ``--workload=missing.jsonl: no such file``. ``allowed`` is appended (what else the option
    takes)."""
    tail = f" ({allowed})" if allowed else ""
    if path.is_dir():
        raise InputError(f"{name}={path}: is a folder, expected a file{tail}")
    if not path.exists():
        raise InputError(f"{name}={path}: no such file{tail}")
    if not os.access(path, os.R_OK):
        raise InputError(f"{name}={path}: not readable (permission denied)")
    return path


def input_folder(path: Path, name: str) -> Path:
    """``path`` if it is a folder this process can read; else an error naming option ``name``."""
    if not path.exists():
        raise InputError(f"{name}={path}: no such folder")
    if not path.is_dir():
        raise InputError(f"{name}={path}: is a file, expected a folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InputError(f"{name}={path}: not readable (permission denied)")
    return path


def output_file(path: Path, name: str) -> Path:
    """``path`` if a file can be written there (missing folders on the way are created by the
    writer); else an error naming option ``name``."""
    if path.is_dir():
        raise InputError(f"{name}={path}: is a folder, expected a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{name}={path}: not writable (permission denied)")
    _nearest_folder_writable(path.parent, path, name)
    return path


def output_folder(path: Path, name: str) -> Path:
    """``path`` if it is, or can be created as, a folder to write into; else an error naming
    option ``name``."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{name}={path}: is a file, expected a folder")
    _nearest_folder_writable(path, path, name)
    return path


def _nearest_folder_writable(start: Path, path: Path, name: str) -> None:
    for folder in (start, *start.parents):
        if folder.exists():
            if not folder.is_dir():
                raise InputError(f"{name}={path}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise InputError(f"{name}={path}: cannot write in {folder} (permission denied)")
            return
