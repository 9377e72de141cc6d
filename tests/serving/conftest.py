import pytest

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
