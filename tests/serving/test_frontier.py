"""Decode's frontier of tokens/s per GPU against tokens/s per user (#13 item 5, first part)."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import product

import matplotlib.pyplot as plt
import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.figures import frontier_figure
from moeinfra.serving.frontier import (
    DEEPSEEK_DECODE_POINT,
    FrontierPoint,
    decode_frontier,
    pareto,
)
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.specs import Deployment, fitting_redundant_experts, hardware

H800 = hardware("h800")


def point(user: float, gpu: float) -> FrontierPoint:
    return FrontierPoint(8, 64, 2, 1.0, 1 / user, gpu, user)


def test_pareto_keeps_exactly_the_undominated_points():
    pts = [
        point(10, 100),
        point(20, 80),
        point(15, 90),
        point(15, 70),
        point(5, 100),
        point(25, 80),
    ]
    got = [(p.tokens_per_s_per_user, p.tokens_per_s_per_gpu) for p in pareto(pts)]
    # (5, 100) ties (10, 100) on GPU and is slower per user; (20, 80) is tied by (25, 80)
    assert got == [(10, 100), (15, 90), (25, 80)]


@pytest.fixture(scope="module")
def h800():
    return decode_frontier(hardware("h800"), nodes=(1, 2, 4, 8, 18), batches=16)


def test_the_frontier_is_what_brute_force_finds(h800):
    undominated = [
        p
        for p in h800.points
        if not any(
            q.tokens_per_s_per_user >= p.tokens_per_s_per_user
            and q.tokens_per_s_per_gpu >= p.tokens_per_s_per_gpu
            and (q.tokens_per_s_per_user, q.tokens_per_s_per_gpu)
            != (p.tokens_per_s_per_user, p.tokens_per_s_per_gpu)
            for q in h800.points
        )
    ]
    assert set(h800.pareto) == set(undominated)


def test_a_bigger_batch_trades_user_speed_for_gpu_throughput(h800):
    shapes = {(p.nodes, p.micro_batches) for p in h800.points}
    assert shapes == set(product((4, 8, 18), (1, 2)))  # 1 and 2 nodes do not hold the model
    for shape in shapes:
        curve = [p for p in h800.points if (p.nodes, p.micro_batches) == shape]
        batch = [p.batch_per_gpu for p in curve]
        assert batch[0] == pytest.approx(1.0) and batch == sorted(batch)
        user = [p.tokens_per_s_per_user for p in curve]
        gpu = [p.tokens_per_s_per_gpu for p in curve]
        assert user == sorted(user, reverse=True) and gpu == sorted(gpu)
        # the largest batch is what the KV cache holds at the mean KV length
        nodes, mb = shape
        unit = PerfModel(Deployment("decode", nodes, fitting_redundant_experts(nodes)), H800)
        assert batch[-1] == pytest.approx(unit.kv_capacity_tokens_per_gpu / 4_989, rel=1e-12)
    assert len(h800.unfit) == 2 and all("does not fit" in why for why in h800.unfit)


def test_best_at_a_user_speed_is_the_frontier_point_with_most_gpu_throughput(h800):
    best = h800.best_at(21.0)
    assert best.tokens_per_s_per_user >= 21.0
    assert best.tokens_per_s_per_gpu == max(
        p.tokens_per_s_per_gpu for p in h800.points if p.tokens_per_s_per_user >= 21.0
    )
    assert h800.best_at(1e6) is None


def test_bad_input_is_refused():
    with pytest.raises(InputError, match="mean_kv"):
        decode_frontier(hardware("h800"), mean_kv=0.0)
    with pytest.raises(InputError, match="no decode unit shape fits"):
        decode_frontier(hardware("h800"), nodes=(1,))


def test_the_figure_draws_every_shape_the_frontier_and_the_published_point(h800):
    fig = frontier_figure(h800, DEEPSEEK_DECODE_POINT)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels.count("frontier") == 1 and "DeepSeek published (EP144, H800)" in labels
    assert sum("micro-batch" in label for label in labels) == 6
    front = next(line for line in ax.get_lines() if line.get_label() == "frontier")
    assert list(front.get_xdata()) == [p.tokens_per_s_per_user for p in h800.pareto]
    star = next(line for line in ax.get_lines() if line.get_label().startswith("DeepSeek"))
    assert (star.get_xdata()[0], star.get_ydata()[0]) == (21.0, 1850.0)
    assert ax.get_xlabel() == "output tokens/s per user"
    plt.close(fig)


def test_cli_writes_json_and_figure(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "frontier", "--nodes", "4,8,18",
         "--json", "-o", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["deepseek_published"] == {
        "tokens_per_s_per_gpu": 1850.0,
        "tokens_per_s_per_user": 21.0,
    }
    assert payload["best_at_deepseek_speed"]["tokens_per_s_per_user"] >= 21.0
    assert json.loads((tmp_path / "frontier.json").read_text())["pareto"] == payload["pareto"]
    image = plt.imread(tmp_path / "frontier.png")
    assert (image[..., :3] < 0.9).mean() > 0.02  # something is drawn, not a blank canvas
    bad = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "frontier", "--nodes", "0,3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--nodes='0,3'" in bad.stderr


def test_mtp_speeds_a_lone_request_up_about_as_deepseek_v3_reports():
    """DeepSeek-V3's report: MTP drafts accepted 85-90% of the time give ~1.8x tokens per second.
    At one request per GPU (fixed costs dominate) the model's speed-up is close to that and never
    above 1 + acceptance; at a full batch it is smaller (the verification's second token doubles
    the GEMM rows)."""
    kw = dict(nodes=(18,), micro_batches=(2,), batches=8)
    plain = decode_frontier(H800, **kw)
    for accept in (0.85, 0.9):
        mtp = decode_frontier(H800, **kw, mtp_acceptance=accept)
        gain = [
            q.tokens_per_s_per_user / p.tokens_per_s_per_user
            for p, q in zip(plain.points, mtp.points, strict=True)
        ]
        assert 1.7 < gain[0] < 1 + accept
        assert gain == sorted(gain, reverse=True) and gain[-1] < gain[0] - 0.3
    # the MTP module's weights and KV cache (one more layer) leave room for fewer requests
    assert mtp.points[-1].batch_per_gpu < plain.points[-1].batch_per_gpu
    with pytest.raises(InputError, match="mtp_acceptance"):
        decode_frontier(H800, mtp_acceptance=1.0)


def test_two_query_tokens_double_everything_but_the_kv_read():
    """Verifying a draft: per micro-batch, the GEMMs and the all-to-all see twice the tokens (the
    same as twice the requests), the attention FLOPs double over the same cached keys, and the KV
    bytes read stay those of one query per request."""
    perf = PerfModel(Deployment("decode", 18), H800)
    b, kv = np.array([8.0, 64.0]), np.array([4_989.0, 4_989.0])
    two = perf._decode_parts(b, kv, queries=2)
    doubled = perf._decode_parts(2 * b, kv)
    for name, x, y in zip(("proj", "shared", "routed", "gate", "dense", "dispatch", "combine"),
                          [two[i] for i in (0, 2, 3, 4, 5, 6, 7)],
                          [doubled[i] for i in (0, 2, 3, 4, 5, 6, 7)], strict=True):  # fmt: skip
        np.testing.assert_allclose(x, y, rtol=1e-12, err_msg=name)
    m, eff = perf.model, perf.eff
    nb = b / 2
    flops = 2 * m.num_heads * (576 + 512) * (2 * nb) * kv
    kv_bytes = nb * kv * 2 * 576
    want = np.maximum(
        flops / (H800.bf16_tflops * 1e12 * eff.attention_compute),
        kv_bytes / (H800.hbm_tb_per_s * 1e12 * eff.memory),
    )
    np.testing.assert_allclose(two[1], want, rtol=1e-12)


def test_cli_refuses_an_acceptance_of_one():
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "frontier", "--mtp", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--mtp-acceptance=1 must be" in done.stderr
