"""The on-disk prefix KV cache: round trip, corruption, LRU under a byte cap, restarts."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moeinfra.server.disk_cache import DiskKVCache

LAYERS, VALUES, BS = 3, 5, 4


def _cache(root, capacity=1 << 20, dtype=torch.float32):
    return DiskKVCache(root, "model-a", BS, LAYERS, VALUES, dtype, capacity)


def _kv(tokens, dtype=torch.float32):
    return torch.randn(LAYERS, tokens, VALUES).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_leaves_one_token_to_compute(tmp_path, dtype):
    cache = _cache(tmp_path, dtype=dtype)
    ids = list(range(100, 113))  # 13 tokens: 3 full blocks
    kv = _kv(13, dtype)
    assert cache.store(ids, kv) == 3
    assert cache.store(ids, kv) == 0  # already there
    hit = cache.lookup(ids)
    assert hit.start == 0 and hit.kv.shape == (LAYERS, 12, VALUES)
    assert torch.equal(hit.kv, kv[:, :12])
    assert cache.cached_tokens(ids) == 12
    # exactly 12 tokens: the last block is not used (one token must be computed)
    assert cache.lookup(ids[:12]).kv.shape[1] == 8
    # a different prefix shares nothing
    assert cache.lookup([1, *ids[1:]]) is None
    assert cache.stats.hit_tokens == 20


def test_skip_tokens_reads_only_blocks_past_what_memory_holds(tmp_path):
    cache = _cache(tmp_path)
    ids, kv = list(range(17)), _kv(17)
    cache.store(ids, kv)
    hit = cache.lookup(ids, skip_tokens=8)
    assert hit.start == 8 and torch.equal(hit.kv, kv[:, 8:16])


def test_a_damaged_block_is_a_miss_and_is_deleted(tmp_path):
    cache = _cache(tmp_path)
    ids, kv = list(range(9)), _kv(9)
    cache.store(ids, kv)
    files = sorted(cache.dir.glob("*/*.kv"), key=os.path.getmtime)
    data = bytearray(files[-1].read_bytes())
    data[-1] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    hit = cache.lookup(ids)
    assert hit is None or hit.kv.shape[1] == 4  # stops before the damaged block
    assert cache.stats.corrupt_blocks == 1
    assert len(list(cache.dir.glob("*/*.kv"))) == 1
    files[0].write_bytes(b"short")  # a torn file
    assert _cache(tmp_path).lookup(ids) is None


def test_byte_cap_evicts_least_recently_used_blocks(tmp_path):
    probe = _cache(tmp_path)
    cap = probe.file_bytes * 4
    cache = _cache(tmp_path, capacity=cap)
    old, new = list(range(9)), list(range(50, 59))
    cache.store(old, _kv(9))
    time.sleep(0.02)
    cache.store(new, _kv(9))
    time.sleep(0.02)
    assert cache.lookup(old) is not None  # refreshes old's blocks
    time.sleep(0.02)
    cache.store(list(range(200, 209)), _kv(9))  # 6 blocks > cap of 4
    assert cache.size_bytes <= cap
    # 3 of 6 blocks go: new's two, then old's tail (a head outlives its tail)
    assert cache.lookup(old).kv.shape[1] == BS
    assert cache.lookup(new) is None  # least recently used: gone
    assert cache.stats.evicted_blocks == 3


def test_eviction_of_a_large_cache_reads_the_times_of_a_sample_only(tmp_path, monkeypatch):
    """A cache past EVICT_SAMPLE_MIN blocks reads EVICT_SAMPLE times per block it deletes, not
    every file's, and deletes the oldest of that sample."""
    from moeinfra.engine.kv_blocks import block_hashes
    from moeinfra.server import disk_cache

    monkeypatch.setattr(disk_cache, "EVICT_SAMPLE_MIN", 64)
    writer = _cache(tmp_path)
    old, newer = list(range(800)), list(range(10_000, 10_800))  # 200 blocks each
    writer.store(old, _kv(800))
    time.sleep(0.02)
    writer.store(newer, _kv(800))
    cache = _cache(tmp_path, capacity=writer.file_bytes * 400)
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(disk_cache.os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p))
    assert cache.evict() == 40  # 400 blocks, down to 90% of the cap
    monkeypatch.undo()
    assert len(stats) == 4 * 40  # of 400 files

    def present(ids):
        return sum(cache._path(d).exists() for d in block_hashes(ids, BS))

    # the sample holds ~80 of the older prompt's blocks, all older than the other's: 40 go
    assert present(old) == 160 and present(newer) == 200
    assert int((cache.dir / disk_cache.LEDGER).read_text()) == cache.size_bytes


def test_eviction_within_one_prompt_takes_the_tail_first(tmp_path):
    probe = _cache(tmp_path)
    cache = _cache(tmp_path, capacity=probe.file_bytes * 2)
    ids, kv = list(range(13)), _kv(13)
    assert cache.store(ids, kv) == 3  # 3 blocks > cap of 2: evict down to 1.8 blocks
    hit = cache.lookup(ids)
    assert hit.start == 0 and torch.equal(hit.kv, kv[:, :BS])


def test_blocks_survive_a_restart_and_no_temporary_file_is_left(tmp_path):
    ids, kv = list(range(9)), _kv(9)
    _cache(tmp_path).store(ids, kv)
    again = _cache(tmp_path)
    assert torch.equal(again.lookup(ids).kv, kv[:, :8])
    assert not list(tmp_path.rglob("*.tmp"))
    other = DiskKVCache(tmp_path, "model-b", BS, LAYERS, VALUES, torch.float32, 1 << 20)
    assert other.lookup(ids) is None  # another model's namespace


def test_a_drafting_unit_leaves_out_the_last_block_of_a_hit(tmp_path):
    """With the MTP layer cached (``reuse_last_block=False``) a block's last entry depends on the
    token after it: a lookup uses a block only when the next one is on disk too, and a prompt
    stores only the blocks a prompt token follows."""
    cache = DiskKVCache(tmp_path, "mtp", BS, LAYERS, VALUES, torch.float32, 1 << 20, False)
    ids, kv = list(range(100, 112)), _kv(12)  # 12 tokens: the third block ends the prompt
    assert cache.store(ids, kv) == 2
    longer = [*ids, 7, 8, 9]
    hit = cache.lookup(longer)  # blocks 0 and 1 on disk: block 0 is used, block 1 recomputed
    assert hit.start == 0 and torch.equal(hit.kv, kv[:, :4])
    assert cache.cached_tokens(longer) == 4
    assert cache.lookup(longer, skip_tokens=4) is None  # memory holds block 0: disk adds nothing
    assert cache.lookup(ids[:5]) is None  # one block matches: it is the last
    assert cache.stats.hit_tokens == 4


def _write_prompts(root: str, capacity: int, first: int, count: int, started) -> None:
    """One writer process: opens the cache, waits for the others to have opened theirs, then
    writes ``count`` prompts of 3 blocks each, token ids from ``first``."""
    cache = _cache(root, capacity=capacity)
    started.wait(60)
    for k in range(count):
        start = first + 1000 * k
        cache.store(list(range(start, start + 13)), _kv(13))


def test_writers_in_several_processes_keep_one_byte_cap(tmp_path):
    """Four processes that opened one directory together (prefill units on several hosts) write
    9 blocks each against a cap of 20: together they pass it, so someone evicts, and the shared
    ledger matches what is on disk (each counting only its own writes, none would evict)."""
    import multiprocessing as mp

    from moeinfra.server.disk_cache import LEDGER

    cap = _cache(tmp_path).file_bytes * 20
    ctx = mp.get_context("spawn")
    started = ctx.Barrier(4)
    writers = [
        ctx.Process(target=_write_prompts, args=(str(tmp_path), cap, 10**6 * w, 3, started))
        for w in range(4)
    ]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    cache = _cache(tmp_path, capacity=cap)
    assert 0 < cache.size_bytes <= cap
    assert int((cache.dir / LEDGER).read_text()) == cache.size_bytes
    assert not list(tmp_path.rglob("*.tmp"))


def test_two_checkpoints_with_the_same_config_do_not_share_a_namespace(tmp_path):
    """The namespace digests the weights too: a fine-tune keeps its base's config.json."""
    from safetensors.torch import save_file

    from moeinfra.server.disk_cache import model_fingerprint

    fingerprints = []
    for name in ("base", "tuned", "copy"):
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "deepseek_v3"}')
        weight = torch.ones(300, 300) * (2.0 if name == "tuned" else 1.0)
        save_file({"w": weight}, model / "model.safetensors")
        fingerprints.append(model_fingerprint(model, torch.float32, BS, (LAYERS, VALUES)))
    base, tuned, copy = fingerprints
    assert base != tuned and base == copy  # the same weights elsewhere share their KV
