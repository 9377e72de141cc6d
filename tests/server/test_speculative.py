"""``serve up --speculative-tokens``: MTP drafts on every unit, across the KV hand-off (the MTP
layer's KV and the first drafts) and through the on-disk prefix cache — the engine's greedy
answers without drafts, and vLLM's ``spec_decode`` metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from tests.server.conftest import disaggregated, greedy_completion, metric, wait_until

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.config import EngineConfig
from moeinfra.engine.tiny import init_tiny
from moeinfra.server.launch import ServeOptions, unit_command

PROMPTS = ["Expert parallelism spreads the experts over GPUs", "hello world"]
LONG = " ".join(["the prefill unit drafts with its MTP layer"] * 3)
MAX_TOKENS = 12
K = 2


@pytest.mark.timeout(300)
def test_drafting_units_answer_as_the_engine_without_drafts_and_reuse_disk_blocks(tmp_path):
    path = init_tiny(tmp_path / "mtp", tokenizer="bpe", config={"num_nextn_predict_layers": 1})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, block_size=4, num_kv_blocks=256) as llm:
        expected = [r.outputs[0].text for r in llm.generate([*PROMPTS, LONG], params)]
    cache_dir = tmp_path / "kvdisk"
    server = disaggregated(path, cache_dir, "--speculative-tokens", str(K))
    try:
        health = httpx.get(f"{server.url}/health").json()
        got = [greedy_completion(server, p, MAX_TOKENS).choices[0].text for p in [*PROMPTS, LONG]]

        def spec(name: str) -> float:
            return metric(server.url, f"moeinfra:spec_decode_num_{name}_total")

        # every token after a request's first comes out of a verification round on the decode
        # unit (1 + its accepted drafts), its first round checking the prefill unit's drafts, but
        # at most one plain step per request at its end (no draft fits under max_tokens)
        emitted = len(got) * (MAX_TOKENS - 1)

        def rounds_cover_the_tokens() -> bool:
            made = spec("drafts") + spec("accepted_tokens")
            return emitted - len(got) <= made <= emitted and spec("drafts") > 0

        wait_until(rounds_cover_the_tokens, timeout_s=5)
        rounds, drafted = spec("drafts"), spec("draft_tokens")
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        assert server.stop() == 0, "".join(server.log)
    assert {u["speculative_tokens"] for u in health["units"].values()} == {K}
    assert got == expected
    assert K * rounds >= drafted > (K - 1) * rounds
    for pos in range(K):
        assert f'moeinfra:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}' in text
    assert "moeinfra:spec_decode_num_accepted_tokens_total" in text
    assert any(cache_dir.rglob("*.kv")), "the prefill unit wrote no KV blocks to disk"
    # a new server on the same folder reads the prompt's blocks (MTP layer too) from disk, all
    # but the last of the hit
    again_server = disaggregated(path, cache_dir, "--speculative-tokens", str(K))
    try:
        again = greedy_completion(again_server, LONG, MAX_TOKENS)
    finally:
        assert again_server.stop() == 0, "".join(again_server.log)
    # blocks of the prompt less its last token, all but the last of them
    blocks = (again.usage.prompt_tokens - 1) // 4
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * (blocks - 1) > 0
    assert again.choices[0].text == expected[-1]


def test_units_are_started_with_the_drafts(tmp_path):
    options = ServeOptions(engine=EngineConfig(num_speculative_tokens=K))
    cmd = unit_command("prefill", 1, "tcp://127.0.0.1:1", options, tmp_path)
    assert cmd[cmd.index("--speculative-tokens") + 1] == str(K)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["serve", "up", "--speculative-tokens", "9"], "--speculative-tokens=9"),
        (["serve", "up", "--speculative-tokens", "-1"], "--speculative-tokens=-1"),
        # the built-in tiny checkpoint has no MTP layer
        (["serve", "up", "--speculative-tokens", "2"], "num_nextn_predict_layers=0"),
        (
            ["serve", "unit", "--server", "tcp://h:1", "--role", "decode"]
            + ["--speculative-tokens", "1"],
            "num_nextn_predict_layers=0",
        ),
    ],
)
def test_bad_speculative_tokens_are_one_line_and_exit_2(args, names):
    r = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in r.stderr


def test_a_unit_that_disagrees_on_drafting_is_refused():
    """A unit joining from another host hands off (or takes) KV with the MTP layer's rows only if
    the server's units do: one that disagrees is told to stop."""
    import msgspec

    from moeinfra.server.messages import Hello
    from moeinfra.server.router import Router

    router = Router("tcp://127.0.0.1:0", "digest", drafting=True)
    info = Hello("decode-x", 0, 1, "decode", "digest", max_num_seqs=4, num_speculative_tokens=0)
    router._hello(b"decode-x/0", info)
    assert not router.units["decode-x"].alive
    assert "does not draft with the MTP layer" in router.notes[-1]
    other = msgspec.structs.replace(info, unit="decode-y", num_speculative_tokens=1)
    router._hello(b"decode-y/0", other)
    assert router.units["decode-y"].ready
