"""Expert parallelism on 1, 2 and 4 spawned gloo ranks: outputs equal the single-process reference."""

import pytest

from moeinfra.moe.launch import launch

from .dist_checks import CHECKS, run_all


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_checks(world):
    results = launch(world, run_all, (list(CHECKS),), timeout_s=100)
    failures = [
        f"rank {rank} {name}: {err}"
        for rank, res in enumerate(results)
        for name, err in res.items()
        if err
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(60)
def test_failing_rank_is_reported_not_hung():
    import time

    from .dist_checks import fail_on_rank_one

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        launch(2, fail_on_rank_one, timeout_s=45)
    assert time.monotonic() - start < 40


def killed_on_rank_one() -> None:
    """Rank 1 is killed (no exception, no error file) while rank 0 waits in a collective."""
    import os
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def sleep_on_rank_one() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


@pytest.mark.timeout(60)
def test_a_killed_rank_is_named_and_its_peers_stopped():
    import multiprocessing

    with pytest.raises(RuntimeError, match="rank 1 of 2 failed, exit code -9:\nit was killed by"):
        launch(2, killed_on_rank_one, timeout_s=45)
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_a_launch_past_its_timeout_stops_every_rank():
    import multiprocessing
    import time

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 4 s"):
        launch(2, sleep_on_rank_one, timeout_s=4)
    assert time.monotonic() - start < 15
    assert not multiprocessing.active_children()
