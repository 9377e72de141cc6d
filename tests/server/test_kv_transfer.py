"""KV hand-off frames: a round trip, and every way a message can arrive wrong."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine.handoff import Handoff
from moeinfra.engine.sampling import SamplingParams
from moeinfra.server.kv_transfer import TransferError, pack, unpack


def _handoff(tokens=10, dtype=torch.float32, drafts=()):
    kv = torch.randn(3, tokens, 6).to(dtype)
    params = SamplingParams(max_tokens=5, seed=4)
    return Handoff("r1", list(range(tokens)), [42], params, kv, 4, "tcp://x:1", list(drafts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(dtype):
    h = _handoff(dtype=dtype)
    frames = pack(h, block_size=4)
    assert len(frames) == 1 + 3  # header and ceil(10 / 4) blocks
    got = unpack([bytes(f) for f in frames], 3, 6, dtype)
    assert torch.equal(got.preloaded.kv, h.kv)
    assert (got.request_id, got.output_ids, got.params) == ("r1", [42], h.params)
    assert got.nbytes == h.kv.numel() * h.kv.element_size()
    assert got.drafts == []


def test_the_first_drafts_travel_with_the_kv():
    """A drafting prefill unit's first MTP drafts reach the decode rank (verified in its first
    step there)."""
    h = _handoff(drafts=[7, 11])
    got = unpack([bytes(f) for f in pack(h, block_size=4)], 3, 6, torch.float32)
    assert got.drafts == [7, 11] and torch.equal(got.preloaded.kv, h.kv)


def test_missing_damaged_and_mismatched_messages_are_refused():
    frames = [bytes(f) for f in pack(_handoff(), block_size=4)]
    with pytest.raises(TransferError, match="2 KV blocks arrived, 3 expected"):
        unpack(frames[:-1], 3, 6, torch.float32)
    bad = bytearray(frames[2])
    bad[5] ^= 1
    with pytest.raises(TransferError, match="block 1 is damaged"):
        unpack([*frames[:2], bytes(bad), frames[3]], 3, 6, torch.float32)
    with pytest.raises(TransferError, match="does not match"):
        unpack(frames, 3, 7, torch.float32)
    with pytest.raises(TransferError) as err:
        unpack(frames, 3, 6, torch.bfloat16)
    assert err.value.request_id == "r1"
