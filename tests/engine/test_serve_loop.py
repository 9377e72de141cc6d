"""The rank loop units run (``worker.serve_loop``): when it may wait for messages."""

from __future__ import annotations

from moeinfra.engine import worker
from moeinfra.engine.core import EngineConfig, EngineCore


def test_a_rank_without_requests_does_not_wait_while_its_unit_is_busy(tiny_path, monkeypatch):
    """A rank with nothing of its own, whose peers have work, must go straight to the next step's
    collective: waiting for messages there holds every busy peer for the whole wait."""
    core = EngineCore(tiny_path, EngineConfig(block_size=16, num_kv_blocks=16))
    busy, idle, stop = [True, False, False, False], [False] * 4, [False, False, True, False]
    agreements = iter([busy, busy, busy, idle, stop])
    monkeypatch.setattr(worker, "agree", lambda core, shutdown, rebalance: next(agreements))
    timeouts = []

    def receive(timeout):
        timeouts.append(timeout)
        return []

    worker.serve_loop(core, receive, lambda outputs: None)
    assert not core.has_work
    assert timeouts[0] > 0  # the unit idle: wait for messages
    assert timeouts[1:4] == [None, None, None]  # a peer busy: no wait
    assert timeouts[4] > 0  # idle again
