"""``moeinfra train``: DualPipeV over 2 gloo ranks gives the one-process losses step by step on the
tiny DeepSeek-V3 with its MTP layer; the checkpoint it writes loads in ``transformers`` and in the
engine, whose MTP drafts are then accepted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.errors import InputError
from moeinfra.train import TrainConfig, train
from moeinfra.train.model import DeepSeekForTraining, stages

SMALL = dict(seq_len=16, micro_batch=2, num_chunks=4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short DualPipeV run (2 ranks): enough steps for the loss to fall well below chance."""
    path = tmp_path_factory.mktemp("train") / "tiny-trained"
    out, losses = train(path, TrainConfig(steps=60, ranks=2, **SMALL), timeout_s=600)
    return out, losses


@pytest.mark.timeout(300)
def test_dualpipev_losses_equal_one_process_losses_step_by_step(tmp_path):
    config = dict(steps=5, **SMALL)
    _, single = train(tmp_path / "one", TrainConfig(ranks=1, **config))
    _, piped = train(tmp_path / "two", TrainConfig(ranks=2, **config), timeout_s=240)
    assert len(single) == len(piped) == 5
    assert max(abs(a - b) for a, b in zip(single, piped, strict=True)) < 1e-5
    assert single[0] != single[-1]  # the weights moved between the steps compared


def test_stages_share_the_models_modules():
    from moeinfra.engine.hf_config import parse_config
    from moeinfra.train.loop import model_config

    model = DeepSeekForTraining(parse_config(model_config(1024)))
    cut = stages(model, 4)
    assert cut[0].embed is cut[-1].embed is model.embed  # both on rank 0 in DualPipeV's V
    layers = [b for stage in cut for b in getattr(stage, "blocks", [])]
    assert layers == list(model.blocks)
    ids = torch.randint(0, 1024, (2, 8))
    x = (ids, ids)
    with torch.no_grad():  # both alike (outside autograd the CPU kernels round their own way)
        for stage in cut:
            x = stage(*x)
        direct = model(ids, ids)
    assert all(torch.allclose(a, b) for a, b in zip(x, direct, strict=True))


def test_training_lowers_the_loss_and_writes_deepseeks_layout(trained):
    path, losses = trained
    assert losses[-1] < losses[0] - 1.0
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    record = json.loads((path / "training.json").read_text())
    assert record["losses"] == losses and record["config"]["ranks"] == 2
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        mtp = f"model.layers.{config['num_hidden_layers']}."
        assert {mtp + "eh_proj.weight", mtp + "shared_head.head.weight"} <= names
        # the MTP layer's embedding and head are copies of the shared ones
        assert torch.equal(
            f.get_tensor(mtp + "embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight")
        )
        assert torch.equal(
            f.get_tensor(mtp + "shared_head.head.weight"), f.get_tensor("lm_head.weight")
        )


def test_the_trained_checkpoint_generates_as_transformers_and_its_drafts_are_accepted(trained):
    import transformers

    path, _ = trained
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompts = ["Expert parallelism spreads the experts", "The decode unit"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(
                ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()
    # the trained MTP layer's drafts are accepted (a random one's almost never are)
    assert llm._core.spec_stats.acceptance_rate > 0.05


def test_the_acceptance_the_engine_measures_feeds_the_serving_model(trained, tmp_path):
    """The trained model's first-draft acceptance, counted by the engine, reported as a unit
    reports it to the server, saved from the server's ``/metrics`` and given to ``serve model
    --mtp-acceptance``: the serving model decodes with exactly that acceptance."""
    from prometheus_client import generate_latest

    from moeinfra.server.messages import State
    from moeinfra.server.metrics import ServerMetrics

    path, _ = trained
    prompts = ["Expert parallelism spreads the experts", "The decode unit", "Prefill and decode"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        llm.generate(prompts, greedy, use_tqdm=False)
        spec = llm._core.spec_stats
    report = State(  # the totals a unit's state report carries (server/unit.py)
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=spec.per_position.tolist(),
    )
    metrics = ServerMetrics()
    metrics.rank_counters(State(), report)
    saved = tmp_path / "metrics.txt"
    saved.write_bytes(generate_latest(metrics.registry))
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "model", "--batch", "1", "--json"]
        + ["--mtp-acceptance", str(saved)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout)
    measured = spec.per_position[0] / spec.num_drafts
    assert 0 < measured < 1
    assert served["mtp"]["acceptance"] == pytest.approx(measured, rel=1e-12)
    assert served["mtp"]["verification_rounds_with_drafts"] == spec.num_drafts
    assert served["output_tokens_per_step_per_request"] == pytest.approx(1 + measured)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ranks": 2, "num_chunks": 2}, "num_chunks=2 must be >= 2 x ranks (ranks=2)"),
        ({"steps": 0}, "steps=0 must be a positive integer"),
        ({"lr": 0.0}, "lr=0.0 must be > 0"),
    ],
)
def test_bad_training_config_is_one_line(changes, message):
    with pytest.raises(InputError) as err:
        TrainConfig(**changes)
    assert message in str(err.value)


def test_cli_trains_and_names_the_option_it_refuses(tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "moeinfra.cli", "train", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    made = cli(str(tmp_path / "t"), "--steps", "2", "--ranks", "1", "--seq-len", "16", "-q")
    assert made.returncode == 0, made.stderr
    assert "checkpoint written to" in made.stdout
    bad = cli(str(tmp_path / "u"), "--num-chunks", "2")
    assert bad.returncode == 2
    assert "--num-chunks=2 must be >= 2 x ranks (--ranks=2)" in bad.stderr
    assert bad.stderr.count("\n") == 1
