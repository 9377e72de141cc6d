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
