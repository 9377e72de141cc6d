"""moeinfra's fused CPU kernels (``csrc/cpu_kernels.cpp``) for steps of a few rows.

A decode step of a few requests on a small model spends its time in the per-call cost of hundreds
of small torch operators, not in their arithmetic: RMSNorm is 8 of them, MLA's absorbed attention
over a paged cache ~45 per layer, the experts of a few routed rows a weight gather and two batched
GEMMs. vLLM's CPU build runs such chains as its own C++ kernels; these are moeinfra's, registered as
torch operators (``torch.ops.moeinfra.*``):

- ``mla_decode``: absorbed MLA attention of one query per request straight from the paged cache's
  slots (no gathered context, no padded mask), float32 inside;
- ``prefill_attention``: causal attention of a prompt chunk over per-head keys and values in
  blocks with a running softmax (no score matrix written); bfloat16 tensors on a CPU with
  AVX512-BF16 multiply in bfloat16 pairs (``vdpbf16ps``, float32 sums) unless the caller passes
  ``bf16_pairs=False`` (what :mod:`moeinfra.moe.cpu_features` says this CPU lacks);
- ``expert_rows``: the SwiGLU experts of a few rows, each run of one slot's rows reading that slot's
  stacked weights in place (no weight gather); given the gate weights, a token's routed pairs and
  their weighted sum (one rank: no sort, no per-pair copies);
- ``route``: DeepSeek-V3's sigmoid routing (scores, bias, group-limited top-k, weights);
- ``rms_norm``: RMSNorm rounding as ``torch.nn.functional.rms_norm`` does;
- ``rope``: the interleaved rotary embedding.

Their callers say when each runs. They are compiled with the machine's C++ compiler (``$CXX``,
default ``g++``) against the installed torch the first time a process needs them (~10 s), into
``$MOEINFRA_CACHE`` (default ``~/.cache/moeinfra``)``/kernels``, and reused after. Where that fails
(no compiler) or with ``MOEINFRA_CPU_KERNELS=0``, every caller runs its torch operators instead,
with the same results up to float rounding; :func:`available` says which.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
ENABLE_ENV = "MOEINFRA_CPU_KERNELS"
_FLAGS = (
    "-O3",
    "-march=native",
    "-mtune=generic",
    "-fopenmp",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
)


def enabled() -> bool:
    """Whether the kernels may be used: not when ``MOEINFRA_CPU_KERNELS=0`` (read on every
    call, so that tests and benchmarks can compare both paths in one process)."""
    return os.environ.get(ENABLE_ENV, "1") != "0"


def available() -> bool:
    """Whether ``torch.ops.moeinfra``'s kernels are enabled and loaded (built on first call)."""
    return enabled() and _load()


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may run on ``tensors`` (every input that may need a gradient among them):
    on the CPU, in float32, bfloat16 or float16 (they compute in float32: not for float64), outside
    autograd, kernels available."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors) and available()


@functools.cache
def _load() -> bool:
    try:
        try:
            torch.ops.load_library(str(build()))
        except OSError:  # a cached library that does not load (truncated, foreign): built anew
            torch.ops.load_library(str(build(rebuild=True)))
    except Exception as error:  # noqa: BLE001 (whatever fails, the torch operators still run)
        detail = getattr(error, "stderr", None) or error
        warnings.warn(
            f"moeinfra's CPU kernels could not be built or loaded ({str(detail).strip()[-400:]}); "
            "running torch operators instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def build(rebuild: bool = False) -> Path:
    """The kernels' shared library for this torch and CPU, compiled unless already cached (or
    ``rebuild``)."""
    compiler = os.environ.get("CXX", "g++")
    command = _command(compiler)
    library = library_path(command)
    root = library.parent
    if rebuild:
        library.unlink(missing_ok=True)
    if library.is_file():
        return library
    if shutil.which(compiler) is None:
        raise OSError(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{library.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together build it once
        if not library.is_file():
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                built = Path(tmp) / library.name
                subprocess.run(
                    [*command[:1], str(SOURCE), "-o", str(built), *command[1:]],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                built.replace(library)
                _prune(root, library)
    return library


# Libraries kept in the cache, the newest built: every source edit, torch version or compiler
# command builds another.
KEPT_LIBRARIES = 8


def _prune(root: Path, built: Path) -> None:
    """Remove all but the :data:`KEPT_LIBRARIES` newest libraries (and their lock files) beside
    ``built``; a process that has one loaded keeps it (removing a file does not unmap it)."""

    def built_at(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile by another process pruning
            return 0.0

    libraries = sorted(root.glob("moeinfra_cpu_*.so"), key=built_at, reverse=True)
    for old in libraries[KEPT_LIBRARIES:]:
        if old != built:
            old.unlink(missing_ok=True)
            (root / f".{old.stem}.lock").unlink(missing_ok=True)


def library_path(command: list[str]) -> Path:
    """Where the library built by ``command`` is cached: ``$MOEINFRA_CACHE`` (default
    ``~/.cache/moeinfra``)``/kernels``, under a key of the source, torch's version, the command
    and the CPU's flags."""
    cache = os.environ.get("MOEINFRA_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "moeinfra"
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), torch.__version__, *command, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    return root / "kernels" / f"moeinfra_cpu_{key}.so"


def _command(compiler: str) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
    ]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them): a library built on another
    CPU sharing the cache is not reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + sys.platform
