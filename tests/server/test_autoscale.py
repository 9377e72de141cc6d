"""``serve up --autoscale``: the simulator's utilisation rule on live work, draining before removal."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moeinfra.errors import InputError
from moeinfra.server.autoscale import AutoscalePolicy, Autoscaler
from moeinfra.server.bench import BenchRequest, replay, token_block
from moeinfra.serving.schedule import units_for_work

from .conftest import ServerProcess, fake_router, wait_until


def test_decisions_follow_the_simulators_rule():
    policy = AutoscalePolicy((1, 3), (1, 3), interval_s=10.0, target=0.5)
    router = fake_router({"p0": ("prefill", 0.0), "d0": ("decode", 0.0), "d1": ("decode", 0.0)})
    started = []
    scaler = Autoscaler(router, started.append, policy)
    scaler.decide(10.0)  # no work yet: decode 2 -> 1 (the least loaded is drained)
    assert sum(u.draining for u in router.units.values()) == 1
    router.units["p0"].ranks[0].busy_s = 12.0  # 12 unit-s in 10 s at target 0.5: 3 units
    router.units["d0"].ranks[0].occupancy_s = 4 * 60.0  # 60 unit-s: 12 units, capped at 3
    decisions = {d["role"]: d for d in scaler.decide(10.0)}
    assert decisions["prefill"]["to"] == int(units_for_work(12.0, 10.0, 0.5)) == 3
    assert decisions["decode"]["to"] == 3 and decisions["decode"]["units"] == 1
    assert started.count("prefill") == 2 and started.count("decode") == 2
    router.accepting = False
    assert scaler.decide(10.0) == []  # shutting down: nothing starts


def test_draining_picks_the_unit_with_fewest_requests():
    router = fake_router({"d0": ("decode", 0.0), "d1": ("decode", 0.0), "p0": ("prefill", 0.0)})
    router.units["d0"].ranks[0].requests.update({"a", "b"})
    Autoscaler(router, lambda role: None, AutoscalePolicy()).decide(10.0)
    assert router.units["d1"].draining and not router.units["d0"].draining


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"prefill_units": (2, 1)}, "--min-prefill-units=2"),
        ({"decode_units": (0, 2)}, "--min-decode-units=0"),
        ({"interval_s": 0.0}, "--autoscale-interval=0.0"),
        ({"target": 1.5}, "--autoscale-target=1.5"),
    ],
)
def test_bad_policies_are_named(kwargs, names):
    with pytest.raises(InputError, match=names):
        AutoscalePolicy(**kwargs)


def test_live_server_scales_decode_out_and_back_in(tiny_bpe):
    """Under a sustained load a second decode unit starts; when idle one drains and stops, and no
    request fails on the way."""
    srv = ServerProcess(
        [
            "--model", str(tiny_bpe), "--prefill-ranks", "1", "--decode-ranks", "1",
            "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "8",
            "--autoscale", "--max-prefill-units", "1", "--max-decode-units", "2",
            "--autoscale-interval", "1.5s", "--autoscale-target", "0.1",
        ]
    )  # fmt: skip
    try:

        def events():
            return httpx.get(f"{srv.url}/health").json()["events"]

        def decode_units():
            units = httpx.get(f"{srv.url}/health").json()["units"].values()
            return [u for u in units if u["role"] == "decode"]

        requests = [BenchRequest(0.1 * i, token_block(i, 48, 1000), 96) for i in range(40)]
        results, _ = asyncio.run(replay(srv.url, requests))
        assert all(r.error is None for r in results), [r.error for r in results if r.error]
        wait_until(lambda: any("autoscale: decode 1 -> 2" in e for e in events()), timeout_s=30)
        # the new unit comes up; idle, the autoscaler drains one and it stops
        wait_until(lambda: sum("(decode) up on" in e for e in events()) == 2, timeout_s=60)
        wait_until(lambda: any("drained and stopped" in e for e in events()), timeout_s=30)
        assert len(decode_units()) == 1
        after, _ = asyncio.run(replay(srv.url, requests[:4]))
        assert all(r.error is None for r in after)
    finally:
        assert srv.stop() == 0, "".join(srv.log)
