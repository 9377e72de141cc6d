"""``moeinfra engine init-tiny`` and ``generate`` as a user runs them; bad input: one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cli(*args, timeout=180, env=None):
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.timeout(200)
def test_init_tiny_then_generate_json_on_two_ranks(tmp_path, tiny_path, reference, prompt_ids):
    path = tmp_path / "tiny"
    made = _cli("init-tiny", str(path), "--tokenizer", "bpe")
    assert made.returncode == 0, made.stderr
    assert "written to" in made.stdout
    from .conftest import MAX_TOKENS, PROMPTS

    proc = _cli(
        "generate", "--model", str(path), "--ranks", "2", "--json", "--ignore-eos",
        "--max-tokens", str(MAX_TOKENS), "-p", PROMPTS[0], "-p", PROMPTS[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in lines] == PROMPTS[:2]
    # same seed and sizes as the session's checkpoint: transformers' greedy tokens
    assert [r["token_ids"] for r in lines] == reference[:2]
    assert all(r["finish_reason"] == "length" for r in lines)


@pytest.mark.timeout(200)
def test_init_tiny_deepseek_v32_then_generate(tmp_path):
    path = tmp_path / "v32"
    made = _cli("init-tiny", str(path), "--tokenizer", "bpe", "--arch", "deepseek_v32")
    assert made.returncode == 0, made.stderr
    assert "tiny DeepSeek-V3.2 checkpoint written to" in made.stdout
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32" and config["index_topk"] == 16
    proc = _cli("generate", "--model", str(path), "--json", "--ignore-eos", "--max-tokens", "24",
                "-p", "Prefill and decode are disaggregated")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert len(record["token_ids"]) == 24  # past index_topk: the last tokens attend sparsely


@pytest.mark.timeout(200)
def test_generate_chat_on_the_default_checkpoint(tmp_path):
    import os

    env = {**os.environ, "MOEINFRA_CACHE": str(tmp_path)}
    proc = _cli("generate", "--chat", "-p", "Hi", "--max-tokens", "3", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"
    assert record["prompt_token_ids"][:2] == [0, 128803]  # BOS, <｜User｜> of DeepSeek-V3
    assert len(record["token_ids"]) <= 3
    assert (tmp_path / "tiny-deepseek-v3" / "config.json").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["generate", "-p", "x", "--model", "/nonexistent"],
            "--model=/nonexistent: no such folder",
        ),
        (["generate", "-p", "x", "--top-p", "2"], "top_p=2.0 must be a number in (0, 1]"),
        (["generate", "-p", "x", "--ranks", "0"], "--ranks=0 must be a positive integer"),
        (["init-tiny", "/tmp/x", "--tokenizer", "gpt2"], "tokenizer='gpt2' is not allowed"),
        (
            ["generate", "-p", "x", "--device", "gpu"],
            "device='gpu' is not allowed; use auto, cpu, cuda or cuda:N",
        ),
        (["init-tiny", "/tmp/x", "--set", "vocab_size=9"], "config key 'vocab_size' cannot be set"),
        (["init-tiny", "/tmp/x", "--set", "hidden_size"], "--set 'hidden_size' must be KEY=VALUE"),
        (
            ["generate", "-p", "x", "--speculative-tokens", "9"],
            "--speculative-tokens=9 must be in 0..8",
        ),
        (
            ["generate", "-p", "x", "--speculative-tokens", "1"],
            "num_nextn_predict_layers=0: the checkpoint has no MTP layer",
        ),
        (
            ["init-tiny", "/tmp/x", "--arch", "deepseek_v5"],
            "arch='deepseek_v5' is not allowed; use one of deepseek_v3, deepseek_v32, deepseek_v4",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tiny_path):
    if args[0] == "generate" and "--model" not in args:
        args = [*args, "--model", str(tiny_path)]
    proc = _cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_engine_options_are_checked_before_torch_is_imported():
    # `serve up` / `engine generate` check their options with EngineConfig / SamplingParams; a typo
    # must not wait for torch.
    code = (
        "import sys\n"
        "from moeinfra.engine import EngineConfig\n"
        "from moeinfra.errors import InputError\n"
        "try:\n"
        "    EngineConfig(dtype='int8')\n"
        "except InputError as e:\n"
        "    print(e)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from moeinfra.engine import SamplingParams\n"
        "SamplingParams(top_p=0.5)\n"
        "assert 'torch' not in sys.modules, 'torch imported by SamplingParams'\n"
        "from moeinfra.engine import LLM\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "dtype='int8' is not allowed; use one of auto, float32, bfloat16, float16"
    )
