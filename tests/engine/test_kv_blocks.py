"""Tests of the paged KV-cache block manager; expectations derived by hand from its rules."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from moeinfra.engine.kv_blocks import BlockManager, block_hashes
from moeinfra.errors import InputError


def _le64(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)


def _computed(mgr: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Admit ``tokens`` as sequence ``seq_id``, compute all of them; returns the cached tokens."""
    cached = mgr.allocate_prefix(seq_id, tokens)
    assert mgr.ensure_slots(seq_id, len(tokens))
    mgr.mark_computed(seq_id, tokens, len(tokens))
    mgr.check()
    return cached


# ---------------------------------------------------------------- block_hashes


def test_block_hashes_format():
    def digest(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(
            parent + _le64(tokens), digest_size=32, person=b"moeinfra-kv"
        ).digest()

    h0 = digest(b"", [1, 2])
    h1 = digest(h0, [3, -4])
    assert block_hashes([1, 2, 3, -4, 5], 2) == [h0, h1]
    assert block_hashes(np.array([1, 2, 3, -4, 5]), 2) == [h0, h1]
    assert block_hashes([1, 2, 3], 4) == []


def test_block_hashes_stable_across_processes():
    tokens = list(range(1000, 1130))
    code = (
        "from moeinfra.engine.kv_blocks import block_hashes; "
        f"print(','.join(h.hex() for h in block_hashes({tokens!r}, 64)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().split(",") == [h.hex() for h in block_hashes(tokens, 64)]


def test_block_hashes_chain():
    a = block_hashes([1, 2, 9, 9], 2)
    b = block_hashes([3, 4, 9, 9], 2)
    c = block_hashes([1, 2, 7, 7], 2)
    assert a[1] != b[1]  # same block tokens, different parents
    assert a[0] == c[0] and a[1] != c[1]


def test_block_hashes_rejects_bad_block_size():
    with pytest.raises(InputError, match="block_size=0"):
        block_hashes([1, 2], 0)


# ---------------------------------------------------------------- prefix hits


def test_hits_only_after_mark_computed():
    mgr = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert mgr.allocate_prefix(0, prompt) == 0
    assert mgr.ensure_slots(0, 10)
    assert mgr.block_table(0) == [0, 1, 2]
    assert mgr.allocate_prefix(1, prompt) == 0  # allocated, not computed
    mgr.mark_computed(0, prompt, 7)  # block 0 full and computed, block 1 not full
    assert mgr.num_cached_blocks == 1
    assert mgr.allocate_prefix(2, prompt) == 4
    mgr.mark_computed(0, prompt, 10)
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(3, prompt) == 8
    assert mgr.block_table(3) == [0, 1]
    mgr.check()


def test_hit_cap_leaves_one_token_to_compute():
    mgr = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    _computed(mgr, 0, prompt)
    assert mgr.allocate_prefix(1, prompt) == 4  # exact multiple: last block recomputed
    assert mgr.allocate_prefix(2, prompt + [99]) == 8
    assert mgr.allocate_prefix(3, prompt[:4]) == 0
    assert mgr.allocate_prefix(4, prompt[:5]) == 4
    assert mgr.allocate_prefix(5, [0, 1, 2, 7, 4, 5, 6, 7, 8]) == 0  # first block differs
    assert mgr.queried_tokens == 8 + 8 + 9 + 4 + 5 + 9
    assert mgr.hit_tokens == 4 + 8 + 4
    assert mgr.hit_rate == pytest.approx(16 / 43)
    mgr.check()


def test_resubmitted_prompt_hits_every_full_block_but_the_capped_one():
    mgr = BlockManager(num_blocks=16)
    prompt = list(range(500, 756))  # 4 full blocks of 64
    tokens = list(prompt)
    assert _computed(mgr, 0, tokens) == 0
    for t in range(70):  # decode: one new token per step
        tokens.append(t)
        assert mgr.ensure_slots(0, len(tokens))
        mgr.mark_computed(0, tokens, len(tokens))
    mgr.free(0)
    assert mgr.num_used_blocks == 0
    assert mgr.allocate_prefix(1, prompt) == 192
    assert mgr.allocate_prefix(2, tokens[:300]) == 256  # the output's full block is cached too
    mgr.check()


def test_two_sequences_share_blocks_with_refcounts():
    mgr = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(9))
    _computed(mgr, 0, prompt)
    assert mgr.block_table(0) == [0, 1, 2]
    assert mgr.allocate_prefix(1, prompt) == 8
    assert mgr.ensure_slots(1, 9)
    assert mgr.block_table(1) == [0, 1, 3]
    assert mgr.num_used_blocks == 4
    mgr.check()

    mgr.free(0)  # blocks 0, 1 still held by sequence 1; block 2 (unhashed) free
    assert mgr.num_used_blocks == 3
    assert mgr.num_free_blocks == 3
    assert mgr.allocate_prefix(2, [50]) == 0
    assert mgr.ensure_slots(2, 12)  # takes every free block, none of the shared ones
    assert sorted(mgr.block_table(2)) == [2, 4, 5]
    assert not mgr.ensure_slots(2, 13)
    mgr.check()

    mgr.free(1)  # 0 and 1 evictable, 3 free
    assert mgr.num_used_blocks == 3
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(3, prompt) == 8
    assert mgr.block_table(3) == [0, 1]
    mgr.free(2)
    mgr.free(3)
    assert mgr.num_used_blocks == 0 and mgr.num_free_blocks == 6
    mgr.check()


def test_duplicate_hash_keeps_first_block():
    mgr = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    for seq_id in (0, 1):  # both admitted before either is computed
        assert mgr.allocate_prefix(seq_id, prompt) == 0
        assert mgr.ensure_slots(seq_id, 9)
    mgr.mark_computed(0, prompt, 9)
    mgr.mark_computed(1, prompt, 9)
    assert mgr.num_cached_blocks == 2
    mgr.check()
    mgr.free(1)  # its blocks 3, 4, 5 have no hash: straight back to the free list
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(2, prompt) == 8
    assert mgr.block_table(2) == [0, 1]
    mgr.check()


# ---------------------------------------------------------------- eviction


def test_evicts_least_recently_released_first():
    mgr = BlockManager(num_blocks=4, block_size=2)
    _computed(mgr, 0, [1, 2, 9])  # blocks [0, 1]; block 0 hashed
    mgr.free(0)  # free list [2, 3, 1], evictable [0]
    _computed(mgr, 1, [3, 4, 9])  # blocks [2, 3]; block 2 hashed
    mgr.free(1)  # free list [1, 3], evictable [0, 2]
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(2, [5, 6, 7, 8, 9]) == 0
    assert mgr.ensure_slots(2, 5)
    assert mgr.block_table(2) == [1, 3, 0]  # free blocks first, then the oldest evictable
    assert mgr.num_cached_blocks == 1
    assert mgr.allocate_prefix(3, [1, 2, 9]) == 0
    assert mgr.allocate_prefix(4, [3, 4, 9]) == 2
    mgr.check()


def test_hit_refreshes_recency():
    mgr = BlockManager(num_blocks=4, block_size=2)
    _computed(mgr, 0, [1, 2, 9])
    mgr.free(0)
    _computed(mgr, 1, [3, 4, 9])
    mgr.free(1)  # evictable [0, 2]
    assert mgr.allocate_prefix(2, [1, 2, 9]) == 2  # takes block 0 again
    mgr.free(2)  # evictable [2, 0]
    assert mgr.allocate_prefix(3, [5, 6, 7, 8, 9]) == 0
    assert mgr.ensure_slots(3, 5)
    assert mgr.block_table(3) == [1, 3, 2]
    assert mgr.allocate_prefix(4, [1, 2, 9]) == 2
    mgr.check()


def test_sequence_releases_tail_block_first():
    mgr = BlockManager(num_blocks=3, block_size=2)
    _computed(mgr, 0, [1, 2, 3, 4, 5])  # blocks [0, 1, 2]; 0 and 1 hashed
    mgr.free(0)  # evictable [1, 0]: the deeper block goes first
    assert mgr.allocate_prefix(1, [7]) == 0
    assert mgr.ensure_slots(1, 4)  # free block 2, then evicts block 1
    assert mgr.block_table(1) == [2, 1]
    assert mgr.allocate_prefix(2, [1, 2, 3, 4, 5]) == 2
    mgr.check()


def test_reset_prefix_cache_drops_only_evictable_hashes():
    mgr = BlockManager(num_blocks=8, block_size=4)
    _computed(mgr, 0, list(range(9)))
    _computed(mgr, 1, list(range(100, 109)))
    mgr.free(0)
    assert mgr.num_cached_blocks == 4
    assert mgr.reset_prefix_cache() == 2
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(2, list(range(9))) == 0
    assert mgr.allocate_prefix(3, list(range(100, 109))) == 8
    mgr.check()


# ---------------------------------------------------------------- allocation and slots


def test_ensure_slots_is_all_or_nothing():
    mgr = BlockManager(num_blocks=4, block_size=4)
    mgr.allocate_prefix(0, [1])
    mgr.allocate_prefix(1, [1])
    assert [mgr.blocks_needed(0, n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert mgr.ensure_slots(0, 8)
    assert mgr.blocks_needed(0, 8) == 0 and mgr.blocks_needed(0, 9) == 1
    assert mgr.blocks_needed(1, 12) == 3
    assert not mgr.can_allocate(3) and mgr.can_allocate(2)
    assert not mgr.ensure_slots(1, 12)
    assert mgr.block_table(1) == [] and mgr.num_free_blocks == 2
    assert mgr.ensure_slots(1, 8)
    assert mgr.block_table(1) == [2, 3] and mgr.num_free_blocks == 0
    assert mgr.ensure_slots(0, 3)  # already holds more: no change
    assert mgr.block_table(0) == [0, 1]
    mgr.check()


def test_slot_mapping_by_hand():
    mgr = BlockManager(num_blocks=4, block_size=4)
    mgr.allocate_prefix(0, [1])
    mgr.ensure_slots(0, 1)  # block 0
    mgr.allocate_prefix(1, [1])
    mgr.ensure_slots(1, 1)  # block 1
    mgr.free(0)  # free list [2, 3, 0]
    mgr.allocate_prefix(2, [1])
    assert mgr.ensure_slots(2, 10)
    assert mgr.block_table(2) == [2, 3, 0]
    slots = mgr.slot_mapping(2, 0, 10)
    assert slots.dtype == np.int64
    assert slots.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 0, 1]
    assert mgr.slot_mapping(2, 6, 9).tolist() == [14, 15, 0]
    assert mgr.slot_mapping(2, 11, 12).tolist() == [3]
    assert mgr.slot_mapping(2, 10, 10).tolist() == []
    assert mgr.slot_mapping(1, 0, 4).tolist() == [4, 5, 6, 7]
    with pytest.raises(InputError, match=r"\(start, end\)=\(0, 13\).*<= 12"):
        mgr.slot_mapping(2, 0, 13)
    with pytest.raises(InputError, match="start, end"):
        mgr.slot_mapping(2, 5, 4)


# ---------------------------------------------------------------- errors and checks


def test_errors():
    with pytest.raises(InputError, match="num_blocks=0"):
        BlockManager(0)
    with pytest.raises(InputError, match="block_size=0"):
        BlockManager(4, block_size=0)
    mgr = BlockManager(num_blocks=4, block_size=4)
    mgr.allocate_prefix(7, [1, 2])
    with pytest.raises(InputError, match="seq_id=7: already allocated"):
        mgr.allocate_prefix(7, [1, 2])
    with pytest.raises(InputError, match="token_ids"):
        mgr.allocate_prefix(8, [])
    for call in (
        lambda: mgr.free(9),
        lambda: mgr.block_table(9),
        lambda: mgr.slot_mapping(9, 0, 0),
        lambda: mgr.ensure_slots(9, 1),
        lambda: mgr.blocks_needed(9, 1),
        lambda: mgr.mark_computed(9, [1], 1),
    ):
        with pytest.raises(InputError, match="seq_id=9: unknown"):
            call()
    with pytest.raises(InputError, match="num_tokens=-1"):
        mgr.ensure_slots(7, -1)
    mgr.ensure_slots(7, 2)
    with pytest.raises(InputError, match=r"num_computed=3: must be in \[0, 2\]"):
        mgr.mark_computed(7, [1, 2], 3)
    with pytest.raises(InputError, match=r"num_computed=5: must be in \[0, 4\]"):
        mgr.mark_computed(7, [1, 2, 3, 4, 5], 5)  # beyond the allocated slots
    mgr.free(7)
    with pytest.raises(InputError, match="seq_id=7: unknown"):
        mgr.free(7)
    mgr.check()


def test_check_detects_broken_invariants():
    mgr = BlockManager(num_blocks=4, block_size=2)
    _computed(mgr, 0, [1, 2, 3])
    mgr._ref[1] += 1
    with pytest.raises(RuntimeError, match="block 1: refcount 2 but held by 1"):
        mgr.check()
    mgr._ref[1] -= 1
    mgr.free(0)
    mgr._free.append(0)  # block 0 is evictable too
    with pytest.raises(RuntimeError, match="block 0: in states"):
        mgr.check()


# ---------------------------------------------------------------- randomized soak


@dataclass
class _Request:
    tokens: list[int]
    fingerprints: list[int]  # fingerprints[i] identifies tokens[: i + 1], i.e. the KV at i
    computed: int
    target: int

    def append(self, token: int) -> None:
        parent = self.fingerprints[-1] if self.fingerprints else 0
        self.tokens.append(token)
        self.fingerprints.append(hash((parent, token)))


def test_random_soak_no_leak_and_correct_hits():
    rng = np.random.default_rng(2024)
    bs = 4
    mgr = BlockManager(num_blocks=12, block_size=bs)
    prefixes = [rng.integers(0, 50, size=n).tolist() for n in (5, 9, 14)]
    content: dict[int, int] = {}  # cache slot -> fingerprint of the KV written there
    live: dict[int, _Request] = {}
    submitted = rejected = preempted = aborted = 0

    def written_by_others(seq_id: int, slots: np.ndarray) -> bool:
        mine = {int(s) // bs for s in slots}
        return any(mine & set(mgr.block_table(o)) for o in live if o != seq_id)

    while submitted < 1000 or live:
        op = rng.random()
        if submitted < 1000 and (op < 0.25 or not live):
            seq_id = submitted
            submitted += 1
            prefix = prefixes[rng.integers(len(prefixes))]
            req = _Request([], [], 0, 0)
            for t in prefix + rng.integers(0, 50, size=rng.integers(0, 6)).tolist():
                req.append(t)
            cached = mgr.allocate_prefix(seq_id, req.tokens)
            mgr.check()
            assert cached % bs == 0 and cached < len(req.tokens)
            hit_slots = mgr.slot_mapping(seq_id, 0, cached)
            assert [content[int(s)] for s in hit_slots] == req.fingerprints[:cached]
            fits = mgr.can_allocate(mgr.blocks_needed(seq_id, len(req.tokens)))
            if rng.random() < 0.05 or not mgr.ensure_slots(seq_id, len(req.tokens)):
                rejected += not fits
                mgr.free(seq_id)
            else:
                assert fits
                req.computed = cached
                req.target = len(req.tokens) + int(rng.integers(1, 10))
                live[seq_id] = req
        elif op < 0.3:
            seq_id = list(live)[rng.integers(len(live))]
            del live[seq_id]
            mgr.free(seq_id)
            aborted += 1
        else:
            seq_id = list(live)[rng.integers(len(live))]
            req = live[seq_id]
            if req.computed == len(req.tokens):
                if len(req.tokens) >= req.target:
                    del live[seq_id]
                    mgr.free(seq_id)
                    mgr.check()
                    continue
                req.append(int(rng.integers(0, 50)))
            if not mgr.ensure_slots(seq_id, len(req.tokens)):
                del live[seq_id]
                mgr.free(seq_id)
                preempted += 1
                mgr.check()
                continue
            end = req.computed + int(rng.integers(1, len(req.tokens) - req.computed + 1))
            slots = mgr.slot_mapping(seq_id, req.computed, end)
            assert not written_by_others(seq_id, slots)
            for pos, slot in zip(range(req.computed, end), slots.tolist(), strict=True):
                content[slot] = req.fingerprints[pos]
            req.computed = end
            mgr.mark_computed(seq_id, req.tokens, end)
        mgr.check()

    assert rejected > 0 and preempted > 0 and aborted > 0
    assert 0.2 < mgr.hit_rate < 1
    assert mgr.num_used_blocks == 0
    assert mgr.num_free_blocks == mgr.num_blocks
    assert mgr.num_cached_blocks > 0
    mgr.check()


def test_cached_prefix_tokens_peeks_without_taking():
    mgr = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert mgr.allocate_prefix(0, tokens) == 0
    assert mgr.ensure_slots(0, 10)
    mgr.mark_computed(0, tokens, 10)  # blocks [0..3] and [4..7] are full and computed
    before = (mgr.hit_tokens, mgr.queried_tokens, mgr.num_free_blocks)
    assert mgr.cached_prefix_tokens(tokens) == 8
    assert mgr.cached_prefix_tokens(tokens[:8]) == 4  # one prompt token must stay uncached
    assert mgr.cached_prefix_tokens([99, *tokens[1:]]) == 0
    assert (mgr.hit_tokens, mgr.queried_tokens, mgr.num_free_blocks) == before
    assert mgr.allocate_prefix(1, tokens) == 8  # what the peek said
    mgr.check()
