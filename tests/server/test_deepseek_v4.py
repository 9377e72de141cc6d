"""``serve up`` on a DeepSeek-V4 checkpoint: prefill, KV hand-off (every layer's window keys,
compressor and indexer projections and compressed entries), decode, and the on-disk prefix cache
across a restart — the engine's greedy answers."""

from __future__ import annotations

import pytest
from tests.server.conftest import disaggregated, greedy_completion

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.tiny import init_tiny

# longer than the window (8) and several compression windows (4 and 16 tokens)
PROMPTS = [
    "Prefill and decode are disaggregated: a prefill unit computes the KV cache and hands it over",
    "Expert parallelism spreads the experts over GPUs and the all-to-all moves tokens back",
]
MAX_TOKENS = 20
LONG = " ".join(["the prefill unit writes its compressed entries to disk"] * 4)
BLOCK = ("--block-size", "16")  # whole compression windows per block


@pytest.mark.timeout(300)
def test_disaggregated_server_answers_as_the_engine_and_reuses_disk_blocks(tmp_path):
    path = init_tiny(tmp_path / "v4", tokenizer="bpe", arch="deepseek_v4")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, block_size=16, num_kv_blocks=64) as llm:
        expected = [r.outputs[0].text for r in llm.generate([*PROMPTS, LONG], params)]
        assert len(llm.tokenizer.encode(LONG)) > 3 * 16
    cache_dir = tmp_path / "kvdisk"
    server = disaggregated(path, cache_dir, *BLOCK)
    try:
        got = [greedy_completion(server, p, MAX_TOKENS).choices[0].text for p in PROMPTS]
        first = greedy_completion(server, LONG, MAX_TOKENS)
    finally:
        assert server.stop() == 0, "".join(server.log)
    assert got == expected[:-1]
    assert first.choices[0].text == expected[-1]
    assert any(cache_dir.rglob("*")), "the prefill unit wrote no KV blocks to disk"
    # a new server on the same folder reads the prompt's whole blocks from disk
    again_server = disaggregated(path, cache_dir, *BLOCK)
    try:
        again = greedy_completion(again_server, LONG, MAX_TOKENS)
    finally:
        assert again_server.stop() == 0, "".join(again_server.log)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].text == expected[-1]
