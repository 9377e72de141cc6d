"""How a CPU process's tensors get their memory: glibc's malloc told to keep what they free."""

from __future__ import annotations

import ctypes
import functools
import platform

# glibc's mallopt parameters (malloc.h) and its ceiling on the mmap threshold on 64-bit hosts
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a CPU rank frees for its next tensors (returns whether
    it could: glibc only). By default glibc maps every allocation above its mmap threshold (128 KB
    at first, adapting up to 32 MB) anew and gives the top of its heap back after frees, so an
    engine step's activations of a few MB land on fresh pages, a page fault and a zeroed page per
    4 KB: ``F.rms_norm`` of ``[2,048, 256]`` float32 rows took 1.2 ms instead of 0.09, a 2,048-token
    float32 prefill step of the benchmarks' small checkpoint 108 ms instead of 88 (2 threads). With
    the threshold fixed at its ceiling and no trimming, tensors up to 32 MB come from the heap and
    freed memory stays with the process for the next step's tensors (larger ones are still mapped:
    the engine keeps its logits below, ``core.LOGITS_PART_BYTES``).
    Process-wide, once; called by a CPU engine once its weights and cache are loaded (the loader's
    large temporaries have gone back by then) and by every rank :func:`moeinfra.moe.launch.launch`
    spawns (``moeinfra moe run`` ~52-56 -> ~49-51 ms a step, ``moeinfra train --steps 100``
    13.0-14.7 -> 12.0-13.2 s)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    trimmed = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(mapped and trimmed)
