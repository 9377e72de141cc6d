"""The demo report: sections build their figures and tables, numbers read as people write them,
and the page opens with what made it (version, date, machine, build time per section)."""

import html
import re
from importlib import metadata

import pytest

from moeinfra.numfmt import format_number
from moeinfra.report.eplb_section import build
from moeinfra.report.page import table_html, write_report

# 1.243e+05, 4.99e+03, 2.4e-07, 1E6: what a table cell must never show
SCIENTIFIC = re.compile(r"\d\.?\d*[eE][+-]?\d")


def _cells(body_html: str) -> list[str]:
    return [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", body_html)]


def test_eplb_section_and_page(tmp_path):
    section = build(tmp_path)
    for name in re.findall(r'src="([^"]+)"', section.body_html):
        assert (tmp_path / name).stat().st_size > 0
    # the published example row reads "True" for both layers
    assert section.body_html.count("<td>True</td>") == 2
    page = write_report(tmp_path, "report", [section])
    text = page.read_text()
    assert 'href="#eplb"' in text and section.body_html in text


def test_engine_section_chats_and_plots(tmp_path, monkeypatch):
    from PIL import Image

    from moeinfra.report import engine_section

    monkeypatch.setenv("MOEINFRA_CACHE", str(tmp_path / "cache"))
    section = engine_section.build(tmp_path)
    png = tmp_path / "engine_decode.png"
    assert png.stat().st_size > 0
    # a real plot: more than one colour in the picture
    assert len(Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10
    rows = re.findall(r"<tr><td>", section.body_html)
    assert len(rows) == len(engine_section._PROMPTS) + len(engine_section._BATCHES)
    assert section.body_html.count("<td>length</td>") + section.body_html.count(
        "<td>stop</td>"
    ) == len(engine_section._PROMPTS)


def test_moe_section_reports_medians_with_spread_and_a_drawn_timeline(tmp_path):
    from PIL import Image

    from moeinfra.report import moe_section

    section = moe_section.build(tmp_path)
    rows = re.findall(
        r"<tr><td>([\d.]+)</td><td>(none|prefill)</td><td>([\d.]+)</td>"
        r"<td>([\d.]+)-([\d.]+)</td><td>([^<]*)</td></tr>",
        section.body_html,
    )
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "none"),
        ("0", "prefill"),
        ("4", "none"),
        ("4", "prefill"),
    ]
    for _, _, median, q1, q3, _ in rows:
        assert float(q1) <= float(median) <= float(q3)
    assert rows[3][5].endswith("%") and all(r[5] == "-" for r in rows[:3])
    assert re.search(
        r"<td>\d+(\.\d+)?%</td>", section.body_html
    )  # communication hidden, traced run
    png = Image.open(tmp_path / "moe_timeline.png").convert("RGB")
    assert len(png.getcolors(maxcolors=1 << 16) or []) > 10


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (124311.4, "124,311"),
        (1.243e05, "124,300"),
        (87072, "87,072"),
        (4989.0, "4,989"),
        (4.99e03, "4,990"),
        (999.96, "1,000"),
        (226.75, "226.8"),
        (96.384, "96.38"),
        (0.011634, "0.01163"),
        (0.001, "0.001"),
        (2.4e-07, "2.4 × 10⁻⁷"),
        (-2.98e-07, "-3.0 × 10⁻⁷"),
        (0.0, "0"),
        (float("nan"), "n/a"),
        (True, "True"),
    ],
)
def test_one_number_rule(value, text):
    assert format_number(value) == text


def test_no_scientific_notation_at_any_magnitude():
    import numpy as np

    for x in np.geomspace(1e-12, 1e15, 271):
        for v in (x, -x, np.float32(x), int(x) if x < 1e15 else 10**15):
            assert not SCIENTIFIC.search(format_number(v)), (v, format_number(v))
    table = table_html(["x (µs)"], [[124311.4], [2.4e-07], [np.float64(4.99e03)], [np.int64(5)]])
    assert _cells(table) == ["124,311", "2.4 × 10⁻⁷", "4,990", "5"]


def test_report_tables_follow_the_number_rule(tmp_path):
    """Every cell of the EPLB, pipeline and trace sections: no 1.243e+05; tiny values only as
    "m × 10⁻ⁿ"; large values with thousands separators."""
    from moeinfra.report import pipeline_section, trace_section

    cells = []
    for builder in (build, pipeline_section.build, trace_section.build):
        cells += _cells(builder(tmp_path).body_html)
    assert len(cells) > 100
    assert not [c for c in cells if SCIENTIFIC.search(c)]
    assert not [c for c in cells if re.fullmatch(r"-?\d{4,}(\.\d+)?", c)]  # 124311 -> 124,311
    assert "124,311" in cells or any(re.fullmatch(r"1\d\d,\d{3}", c) for c in cells)


@pytest.mark.parametrize(
    ("seconds", "cell"), [(0.0008, "0.8"), (1.5743, "1,574"), (12.345, "12,345")]
)
def test_eplb_timing_cell_follows_the_number_rule_however_long_planning_takes(
    tmp_path, monkeypatch, seconds, cell
):
    """The planning time is printed by the one rule whatever this machine measures (a slow or
    cold first call once printed 1574.3)."""
    from moeinfra.report import eplb_section

    def timed(fn, repeats):
        return seconds, fn()

    monkeypatch.setattr(eplb_section, "median_time", timed)
    body = eplb_section.build(tmp_path).body_html
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    timings = [re.findall(r"<td>([^<]*)</td>", r)[-1] for r in rows if "GPUs)" in r]
    assert timings and set(timings) == {cell}
    assert "%" in body  # the gaps to the bound, by the same rule


def test_pipeline_parameters_agree_with_deepseeks_table_and_with_each_other(tmp_path):
    """Same PP stages (DeepSeek's table): DualPipe and DualPipeV 2x, each device holding two 1/8
    slices; same 8 devices: DualPipeV's two slices are 1/16 each, 1x; DualPipe 2x in both."""
    from moeinfra.report import pipeline_section

    rows = {r[0]: r for r in pipeline_section.bubble_rows()}
    assert [rows[m][6:8] for m in ("1F1B", "ZB1P", "DualPipe", "DualPipeV")] == [
        ["1x", "1 × 1/8"],
        ["1x", "1 × 1/8"],
        ["2x", "2 × 1/8"],
        ["2x", "2 × 1/8"],
    ]
    body = pipeline_section.build(tmp_path).body_html
    assert "stages)" not in body
    compared = dict(
        re.findall(r"<tr><td>(\w+)(?: \(best\))?</td>(?:<td>[^<]*</td>){3}<td>(\d+x)</td>", body)
    )
    assert compared == {
        "gpipe": "1x",
        "1f1b": "1x",
        "zb1p": "1x",
        "dualpipe": "2x",
        "dualpipev": "1x",
    }
    assert "<td>2 × 1/16</td>" in body


def test_title_block_names_version_date_machine_and_section_times(tmp_path):
    from moeinfra.report import pipeline_section
    from moeinfra.report.demo import build_demo_report

    index = build_demo_report(tmp_path, quiet=True, builders=[("Pipeline", pipeline_section.build)])
    text = index.read_text()
    head = text[: text.index("<ul>")]  # the title block comes before the table of contents
    cells = _cells(head)
    about = dict(zip(cells[0::2], cells[1::2], strict=False))
    assert about["project"] == "moeinfra"
    assert about["version"].startswith(metadata.version("moeinfra"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", about["generated"])
    for key in ("CPU", "cores", "RAM", "OS", "Python", "numpy"):
        assert about[key] and about[key] != "unknown", key
    assert about["RAM"].endswith("GiB")
    assert re.fullmatch(r"[\d.,]+ / [\d.,]+", about["load average (1 min), start / end"])
    timing = re.search(r"<td>Pipeline</td><td>([\d.,]+)</td><td>(\d+)%</td>", head)
    assert timing and float(timing.group(1)) > 0 and timing.group(2) == "100"
    assert re.search(r"<td>total</td><td>[\d.,]+</td>", head)


@pytest.mark.timeout(300)
def test_training_section_plots_the_loss_and_measures_acceptance(tmp_path, monkeypatch):
    from PIL import Image

    from moeinfra.report import train_section

    monkeypatch.setattr(train_section, "_STEPS", 30)
    section = train_section.build(tmp_path)
    png = tmp_path / "train_loss.png"
    assert len(Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10
    cells = _cells(section.body_html)
    assert cells[:1] == ["1"] and cells[-5] == "3"  # rows for 1, 2 and 3 drafts per step
    assert all(c.endswith("%") or c == "—" for c in cells[1:4])
    assert not [c for c in cells if SCIENTIFIC.search(c)]


def test_signed_differences_follow_the_number_rule():
    from moeinfra.numfmt import signed_percent

    assert [signed_percent(x) for x in (0.1234, -0.03, 0.0, 1e-5)] == [
        "+12.34%",
        "-3%",
        "0%",
        "+0.001%",
    ]


def test_architectures_section_plots_and_tabulates_the_four_models(tmp_path):
    """FLOPs and KV per token against the context for V3, V3.2, V4-Flash and V4-Pro, and a table
    whose last columns put the counted 1M-token shares of V3.2 beside the model card's."""
    from PIL import Image

    from moeinfra.report import arch_section

    section = arch_section.build(tmp_path)
    png = Image.open(tmp_path / "arch_per_token.png").convert("RGB")
    assert len(png.getcolors(maxcolors=1 << 16) or []) > 10
    cells = _cells(section.body_html)
    assert [c for c in cells if c.startswith("deepseek-")] == [
        "deepseek-v3",
        "deepseek-v3.2",
        "deepseek-v4-flash",
        "deepseek-v4-pro",
    ]
    assert (
        sum(c.endswith(" / 27%") or c.endswith(" / 10%") or c.endswith(" / 7%") for c in cells) == 4
    )
    assert not any(SCIENTIFIC.search(c) for c in cells)
