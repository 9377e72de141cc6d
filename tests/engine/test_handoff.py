"""A request prefilled on one engine and decoded on another gives the tokens of one engine."""

from __future__ import annotations

import torch

from moeinfra.engine.core import EngineConfig, EngineCore
from moeinfra.engine.sampling import SamplingParams
from moeinfra.engine.sequence import Preloaded


def _run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_prefill_here_decode_there_equals_one_engine(tiny_path, prompt_ids):
    config = EngineConfig(num_kv_blocks=64, block_size=16)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    together = EngineCore(tiny_path, config)
    for i, ids in enumerate(prompt_ids[:6]):
        together.add_request(f"r{i}", ids, params[i % 3])
    expected = _run(together)

    prefill, decode = EngineCore(tiny_path, config), EngineCore(tiny_path, config)
    for i, ids in enumerate(prompt_ids[:6]):
        prefill.add_request(f"r{i}", ids, params[i % 3], handoff=("decode", 0))
    got = _run(prefill)
    assert all(len(t) == 1 for t in got.values())  # the first token only
    assert {h.request_id for h in prefill.handoffs} == {f"r{i}" for i in range(6) if i % 3 != 2}
    assert prefill.blocks.num_used_blocks == 0  # prefill side freed everything it handed off
    for h in prefill.handoffs:
        assert h.kv.shape[:2] == (together.cache.data.shape[0], len(h.prompt_ids))
        assert h.target == ("decode", 0)
        # what travels is the MLA latent cache: bytes per token as the layout (MLA formula) says
        nbytes = h.kv.numel() * h.kv.element_size()
        assert nbytes == len(h.prompt_ids) * together.cache.layout.bytes_per_token
        decode.add_request(
            h.request_id,
            h.prompt_ids,
            h.params,
            output_ids=h.output_ids,
            preloaded=Preloaded(0, h.kv),
        )
    for rid, more in _run(decode).items():
        got[rid].extend(more)
    assert got == expected


def test_preloaded_prefix_skips_computing_and_matches(tiny_path, prompt_ids):
    """KV of a prompt's first blocks read from elsewhere (as from the on-disk cache) is used as is."""
    config = EngineConfig(num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    ids = prompt_ids[4]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = EngineCore(tiny_path, config)
    first.add_request("a", ids, params, handoff="keep")
    _run(first)
    kv = first.handoffs[0].kv
    cut = (len(ids) - 1) // 4 * 4
    second = EngineCore(tiny_path, config)
    second.add_request("b", ids, params, preloaded=Preloaded(0, kv[:, :cut].clone()))
    out = _run(second)
    assert second.stats[0].prefill_tokens == len(ids) - cut
    plain = EngineCore(tiny_path, config)
    plain.add_request("c", ids, params)
    assert out["b"] == _run(plain)["c"]
    # corrupt preloaded KV changes the answer: the rows really are used
    third = EngineCore(tiny_path, config)
    noise = torch.randn_like(kv[:, :cut]) * 10
    third.add_request("d", ids, params, preloaded=Preloaded(0, noise))
    assert _run(third)["d"] != out["b"]
