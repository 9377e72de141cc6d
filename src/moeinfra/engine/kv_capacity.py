"""How many KV blocks a rank's cache holds: as given, or sized from memory as vLLM sizes its own.

``num_kv_blocks`` fixes the count; else ``kv_cache_memory_bytes`` is one rank's cache in bytes
(vLLM's ``--kv-cache-memory-bytes``, its CPU build's ``VLLM_CPU_KVCACHE_SPACE``); else the cache
takes what is left of the rank's share of ``memory_utilization`` of the device's memory (vLLM's
``gpu_memory_utilization``, which its CPU build applies to the host's memory): on the CPU, the
host's total memory times ``memory_utilization``, split evenly over the ranks on this host, less
what the rank's process holds once its weights are loaded (its resident set), and never more than
the host has available; on a GPU, ``memory_utilization`` of what is free on it once the weights
are loaded (so a second engine in the same process, a test's, still finds room). On the CPU the cache's pages are committed as they are first written
(:func:`moeinfra.engine.kv_cache.PagedKVCache`), so a large cache costs what its requests fill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moeinfra.errors import InputError

GiB = 1 << 30


@dataclass(frozen=True)
class KVCapacity:
    """``blocks`` of the cache and ``how`` they were chosen (one line for the start-up log)."""

    blocks: int
    how: str


def host_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of this host's memory (``/proc/meminfo``)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kv_capacity(config, bytes_per_block: int, device: torch.device, host_ranks: int) -> KVCapacity:
    """The blocks of one rank's cache for engine ``config`` (see the module), ``bytes_per_block``
    each, on ``device``, one of ``host_ranks`` ranks sharing this host's memory."""
    if config.num_kv_blocks is not None:
        return KVCapacity(config.num_kv_blocks, "num_kv_blocks")
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
        how = f"kv_cache_memory_bytes {budget / GiB:.2f} GiB"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(config.memory_utilization * free)
        how = f"{config.memory_utilization:g} of the GPU's {free / GiB:.1f} GiB free of {total / GiB:.1f}"
    else:
        total, available = host_memory()
        share = int(config.memory_utilization * total / max(host_ranks, 1))
        held = resident_bytes()
        budget = min(share - held, available // max(host_ranks, 1))
        how = (
            f"{config.memory_utilization:g} of the host's {total / GiB:.1f} GiB over {host_ranks} "
            f"rank(s), less this rank's {held / GiB:.2f} GiB resident"
        )
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise InputError(
            f"no memory left for the KV cache ({how}: {budget / GiB:.2f} GiB, one block is "
            f"{bytes_per_block:,} bytes); raise memory_utilization, set kv_cache_memory_bytes or "
            "num_kv_blocks, or free memory"
        )
    return KVCapacity(int(blocks), how)


def describe(capacity: KVCapacity, block_size: int, bytes_per_block: int) -> str:
    """The start-up line: tokens, blocks, bytes and how they were chosen."""
    tokens = capacity.blocks * block_size
    size = capacity.blocks * bytes_per_block / GiB
    return (
        f"KV cache: {tokens:,} tokens ({capacity.blocks:,} blocks of {block_size}, "
        f"{size:.2f} GiB; {capacity.how})"
    )
