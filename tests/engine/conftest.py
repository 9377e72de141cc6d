"""Shared fixtures: the tiny checkpoint (trained BPE tokenizer) and transformers' greedy reference."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine.tiny import init_tiny

# Mixed lengths; several share long prefixes (so block-level prefix sharing has something to share).
PROMPTS = [
    "The decode unit",
    "Prefill and decode are disaggregated: a prefill unit computes the KV cache",
    "Prefill and decode are disaggregated: a prefill unit computes the first token",
    "x",
    "Expert parallelism spreads the experts over GPUs and the all-to-all moves tokens",
    "Expert parallelism spreads the experts over GPUs and the all-to-all moves tokens back",
    "hello world",
    "The decode unit runs EP144 with 32 redundant experts",
    "KV cache",
    "Prefill and decode are disaggregated",
]
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer="bpe")


@pytest.fixture(scope="session")
def single_file_path(tmp_path_factory):
    """The same checkpoint as ``tiny_path`` stored as one ``model.safetensors`` with no index."""
    return init_tiny(tmp_path_factory.mktemp("ckpt") / "single", tokenizer="bpe", shards=1)


@pytest.fixture(params=["sharded", "single-file"])
def layout_path(request):
    """Each storage layout of the tiny checkpoint: shards with an index, and one file."""
    name = "tiny_path" if request.param == "sharded" else "single_file_path"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def hf_model(tiny_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def prompt_ids(tiny_path):
    from moeinfra.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_path)
    return [tok.encode(p) for p in PROMPTS]


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (one prompt at a time, no padding, EOS
    ignored)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def check_greedy(outputs, reference, prompts) -> None:
    """The engine's outputs are for ``prompts`` and continue each as ``reference`` does."""
    assert [o.prompt_token_ids for o in outputs] == prompts
    for o, ref in zip(outputs, reference, strict=True):
        assert o.outputs[0].token_ids == ref, o.prompt


def edit_config(path, **changes) -> None:
    """Change keys of ``path/config.json`` (None removes the key)."""
    import json

    raw = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="session")
def reference(hf_model, prompt_ids):
    """transformers' greedy continuation of every prompt."""
    return hf_greedy(hf_model, prompt_ids, MAX_TOKENS)


def one_rank_model(path):
    """``(architecture, config, model)``: the checkpoint in ``path`` as one rank holding every
    expert, float32 (what the logits tests compare with transformers)."""
    import numpy as np

    from moeinfra.engine.checkpoint import CheckpointReader
    from moeinfra.engine.hf_config import read_config
    from moeinfra.engine.registry import architecture
    from moeinfra.eplb import rebalance
    from moeinfra.moe.comm import Communicator

    raw = read_config(path)
    arch = architecture(raw["model_type"])
    config = arch.parse_config(raw, "config.json")
    experts = config.block.num_routed_experts
    plan = rebalance(
        np.ones((config.num_moe_layers, experts)), experts, config.block.num_expert_groups, 1, 1
    )
    model = arch.load(CheckpointReader(path), config, plan, Communicator(), torch.float32)
    return arch, config, model


def check_warm_up_leaves_no_trace(path, prompts, reference, **config) -> None:
    """:meth:`EngineCore.warm_up` then greedy requests: the warm-up ran a prompt, left the engine
    as it found it (blocks, prefix cache, counters, expert loads, per-sequence state) and the
    requests still continue as ``reference`` does."""
    from moeinfra.engine import EngineConfig, EngineCore, SamplingParams
    from moeinfra.engine.worker import run_steps

    core = EngineCore(path, EngineConfig(**config))
    free = core.blocks.num_free_blocks
    assert core.warm_up() > 1
    assert core.blocks.num_free_blocks == free and core.blocks.num_cached_blocks == 0
    assert core.blocks.queried_tokens == 0 and core.steps == 0 and not core.stats
    assert all(int(layer.load_counts.sum()) == 0 for layer in core.model.moe)
    # DeepSeek-V4's attention keeps per-sequence state outside the cache
    assert not any(getattr(module, "held", None) for module in core.model.modules())
    params = SamplingParams(temperature=0, max_tokens=len(reference[0]), ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, params)
    tokens = {}
    for outputs in run_steps(core):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == reference
