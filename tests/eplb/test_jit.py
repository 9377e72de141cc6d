"""The first call in a fresh environment: interpreted kernels (identical plans) while one background
process compiles them into numba's cache; compiled in every process started after it."""

import json
import os
import subprocess
import sys
import time

import pytest

_PLANS = """
import json, numpy as np
from moeinfra.eplb import jit, rebalance, rebalance_experts
rng = np.random.default_rng(3)
load = rng.lognormal(size=(6, 32)) * 100
drift = load * rng.uniform(0.7, 1.3, size=load.shape)
out = {"compiled": jit.COMPILED}
for policy, nodes in (("hierarchical", 2), ("global", 1), ("deepseek", 2)):
    plan = rebalance(load, 48, 8, nodes, 16, policy=policy)
    out[policy] = plan.phy2log.tolist()
    if policy != "deepseek":
        moved = rebalance(drift, 48, 8, nodes, 16, policy=policy, previous=plan, max_moves=5)
        out[policy + "/migrated"] = moved.phy2log.tolist()
out["deepseek_release"] = [t.tolist() for t in rebalance_experts(load, 48, 8, 2, 16)]
print(json.dumps(out))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_interpreted_and_compiled_kernels_give_identical_plans():
    got = {}
    for mode in ("interpreted", "compiled"):
        proc = _run(_PLANS, MOEINFRA_EPLB_JIT=mode)
        assert proc.returncode == 0, proc.stderr
        got[mode] = json.loads(proc.stdout)
        assert got[mode].pop("compiled") == (mode == "compiled")
    assert got["interpreted"] == got["compiled"]


@pytest.mark.timeout(300)
def test_cold_cache_runs_interpreted_and_warms_in_the_background(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path), "MOEINFRA_EPLB_JIT": "auto"}
    first = _run(_PLANS + "print(jit.marker_path())", **env)
    assert first.returncode == 0, first.stderr
    plans, marker = first.stdout.splitlines()
    assert json.loads(plans)["compiled"] is False
    assert marker.startswith(str(tmp_path))
    deadline = time.monotonic() + 200
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert os.path.exists(marker), "the background warm-up never finished"
    assert not os.path.exists(marker[: -len(".ok")] + ".lock")
    assert any(name.endswith(".nbi") for _, _, names in os.walk(tmp_path) for name in names)
    second = _run(_PLANS, **env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["compiled"] is True


def test_unknown_mode_is_refused_in_one_line():
    proc = _run("import moeinfra.eplb", MOEINFRA_EPLB_JIT="fast")
    assert proc.returncode != 0
    assert "MOEINFRA_EPLB_JIT='fast' is not one of auto, compiled, interpreted" in proc.stderr
