"""The KV cache's size: as given, or from memory as vLLM sizes its own."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine import EngineConfig
from moeinfra.engine import kv_capacity as capacity
from moeinfra.engine.kv_cache import zeros_on_first_write
from moeinfra.errors import InputError

GiB = 1 << 30
CPU = torch.device("cpu")


def test_blocks_given_or_from_bytes_or_from_the_hosts_share(monkeypatch):
    monkeypatch.setattr(capacity, "host_memory", lambda: (20 * GiB, 15 * GiB))
    monkeypatch.setattr(capacity, "resident_bytes", lambda: 2 * GiB)
    per_block = 1 << 20
    given = capacity.kv_capacity(EngineConfig(num_kv_blocks=7), per_block, CPU, 1)
    assert given.blocks == 7
    sized = capacity.kv_capacity(EngineConfig(kv_cache_memory_bytes=3 * GiB), per_block, CPU, 4)
    assert sized.blocks == 3 * 1024 and "3.00 GiB" in sized.how
    # 0.9 x 20 GiB over 2 ranks = 9 GiB, less 2 resident: 7 GiB (under the 7.5 available each)
    auto = capacity.kv_capacity(EngineConfig(), per_block, CPU, 2)
    assert auto.blocks == 7 * 1024
    assert (
        auto.how == "0.9 of the host's 20.0 GiB over 2 rank(s), less this rank's 2.00 GiB resident"
    )
    # never more than the host has available now, per rank
    monkeypatch.setattr(capacity, "host_memory", lambda: (20 * GiB, 4 * GiB))
    assert capacity.kv_capacity(EngineConfig(), per_block, CPU, 2).blocks == 2 * 1024
    line = capacity.describe(auto, 64, per_block)
    assert line.startswith("KV cache: 458,752 tokens (7,168 blocks of 64, 7.00 GiB; 0.9 of")


def test_no_memory_left_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(capacity, "host_memory", lambda: (4 * GiB, 4 * GiB))
    monkeypatch.setattr(capacity, "resident_bytes", lambda: 3 * GiB)
    with pytest.raises(InputError, match="no memory left for the KV cache .*memory_utilization"):
        capacity.kv_capacity(EngineConfig(memory_utilization=0.5), 1 << 20, CPU, 1)
    with pytest.raises(InputError, match=r"memory_utilization=1.5 must be in \(0, 1\]"):
        EngineConfig(memory_utilization=1.5)
    with pytest.raises(InputError, match="num_kv_blocks=0 must be >= 1"):
        EngineConfig(num_kv_blocks=0)


def test_a_gpu_cache_takes_its_share_of_what_is_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * GiB))
    sized = capacity.kv_capacity(EngineConfig(), GiB, torch.device("cuda", 0), 8)
    assert sized.blocks == 54 and sized.how == "0.9 of the GPU's 60.0 GiB free of 80.0"


def test_a_cpu_cache_commits_its_pages_as_they_are_written():
    before = capacity.resident_bytes()
    data = zeros_on_first_write((2, 1 << 26), torch.float32)  # 512 MiB
    assert data.shape == (2, 1 << 26) and data.dtype == torch.float32
    assert capacity.resident_bytes() - before < 64 << 20
    assert not data[:, :: 1 << 16].any()  # reads as zeros
    data[1, :1000] = 3.0
    assert float(data.sum()) == 3000.0
    half = zeros_on_first_write((4, 8), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and not half.any()


def test_an_engine_sizes_its_cache_from_memory_and_says_so(tiny_path, capfd):
    from moeinfra.engine import EngineCore

    core = EngineCore(tiny_path, EngineConfig(kv_cache_memory_bytes=64 << 20))
    per_block = core.cache.layout.bytes_per_token * core.config.block_size
    assert core.cache.num_blocks == core.blocks.num_blocks == (64 << 20) // per_block
    err = capfd.readouterr().err
    assert f"moeinfra engine: KV cache: {core.cache.num_blocks * 64:,} tokens" in err
    assert "kv_cache_memory_bytes 0.06 GiB" in err
