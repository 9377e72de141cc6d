import pytest

from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.scenario import build_scenario


@pytest.fixture(scope="session")
def day_result():
    """DeepSeek's whole published day, the default scenario (1 simulated request per 100 real)."""
    return build_scenario().run()


@pytest.fixture(scope="session")
def hour_result():
    """The first simulated hour of the day at 1:200 (a reduced-scale run for most tests)."""
    scenario = build_scenario(hours=1.0, scale=200.0)
    return scenario, scenario.run()


@pytest.fixture
def index_logits_work(monkeypatch):
    """``(FLOPs, bytes)`` of every indexer-logits kernel the performance model costs from here
    on, in call order (:meth:`PerfModel._index_logits_work`, recorded as it answers)."""
    seen = []
    work = PerfModel._index_logits_work

    def spy(self, *args):
        seen.append(work(self, *args))
        return seen[-1]

    monkeypatch.setattr(PerfModel, "_index_logits_work", spy)
    return seen


def pytest_collection_modifyitems(items):
    """Tests on the whole simulated day take a minute to set up: marked ``slow``, so ``make mutate``
    (``-m "not slow"``, which sets fixtures up again for every mutant) leaves them out."""
    for item in items:
        if "day_result" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
