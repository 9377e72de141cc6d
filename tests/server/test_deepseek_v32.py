"""``serve up`` on a DeepSeek-V3.2 checkpoint: prefill, KV hand-off (latent, RoPE key and index
key), decode, and the on-disk prefix cache across a restart — the engine's greedy answers."""

from __future__ import annotations

import pytest
from tests.server.conftest import disaggregated, greedy_completion

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.tiny import TINY_INDEXER, init_tiny

# every prompt plus its output is longer than index_topk (16): decode attends sparsely
PROMPTS = [
    "Prefill and decode are disaggregated: a prefill unit computes the KV cache",
    "Expert parallelism spreads the experts over GPUs and the all-to-all moves tokens",
    "hello world",
]
MAX_TOKENS = 20
LONG = " ".join(["the prefill unit writes its index keys to disk"] * 4)


@pytest.mark.timeout(300)
def test_disaggregated_server_answers_as_the_engine_and_reuses_disk_blocks(tmp_path):
    path = init_tiny(tmp_path / "v32", tokenizer="bpe", arch="deepseek_v32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, block_size=4, num_kv_blocks=256) as llm:
        expected = [r.outputs[0].text for r in llm.generate([*PROMPTS, LONG], params)]
        assert len(llm.tokenizer.encode(LONG)) > 2 * TINY_INDEXER["index_topk"]
    cache_dir = tmp_path / "kvdisk"
    server = disaggregated(path, cache_dir)
    try:
        got = [greedy_completion(server, p, MAX_TOKENS).choices[0].text for p in PROMPTS]
        first = greedy_completion(server, LONG, MAX_TOKENS)
    finally:
        assert server.stop() == 0, "".join(server.log)
    assert got == expected[:-1]
    assert first.choices[0].text == expected[-1]
    assert any(cache_dir.rglob("*")), "the prefill unit wrote no KV blocks to disk"
    # a new server on the same folder reads the prompt's blocks (index keys too) from disk
    again_server = disaggregated(path, cache_dir)
    try:
        again = greedy_completion(again_server, LONG, MAX_TOKENS)
    finally:
        assert again_server.stop() == 0, "".join(again_server.log)
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * TINY_INDEXER["index_topk"] // 2
    assert again.choices[0].text == expected[-1]
