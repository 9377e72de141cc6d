"""The digitised DeepSeek day embedded in moeinfra.serving equals the CSVs in examples/data."""

import csv
from pathlib import Path

from moeinfra.serving.scenario import PUBLISHED_HOURLY_INCOME
from moeinfra.serving.schedule import DEEPSEEK_DAY_STEPS
from moeinfra.serving.workload import DEEPSEEK_DAY_DEMAND

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def _rows(name: str) -> list[dict[str, str]]:
    with (DATA / name).open() as handle:
        return list(csv.DictReader(handle))


def test_node_schedule_matches_the_csv():
    rows = _rows("deepseek_day6_node_schedule.csv")
    expected = [
        (
            float(r["start_hours_since_1200"]),
            int(r["nodes"]),
            int(r["hyp_decode_units_18n"]),
            int(r["hyp_prefill_units_4n"]),
        )
        for r in rows
    ]
    assert list(DEEPSEEK_DAY_STEPS) == expected
    for _, nodes, decode_units, prefill_units in DEEPSEEK_DAY_STEPS:
        assert nodes == 18 * decode_units + 4 * prefill_units


def test_hourly_demand_and_income_match_the_csv():
    rows = _rows("deepseek_day6_hourly.csv")
    assert list(DEEPSEEK_DAY_DEMAND) == [float(r["demand_rel_peak"]) for r in rows]
    assert list(PUBLISHED_HOURLY_INCOME) == [float(r["income_usd_scaled"]) for r in rows]
