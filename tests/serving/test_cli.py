"""``moeinfra serve`` round trips."""

import json
import subprocess
import sys

import pytest

from moeinfra.cli.options import parse_duration_s
from moeinfra.errors import InputError


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


REQUIRED = [
    "hours",
    "peak_nodes",
    "avg_nodes",
    "cost_usd",
    "input_tokens",
    "cache_hit_input_tokens",
    "output_tokens",
    "revenue_usd",
    "margin",
    "prefill_tokens_per_s_per_node",
    "decode_tokens_per_s_per_node",
    "mean_output_tokens_per_s",
    "mean_kv_len_per_output_token",
    "requests",
    "hourly",
]


def test_simulate_json_and_output_folder(tmp_path):
    result = cli("simulate", "--hours", "0.25", "--scale", "400", "--json", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    for key in REQUIRED:
        assert key in payload
    req = payload["requests"]
    assert set(req) >= {"arrived", "completed", "running", "rejected"}
    assert req["arrived"] == req["completed"] + req["running"] + req["rejected"]
    assert payload["hourly"][0]["nodes"] == 278
    assert {"hour", "nodes", "cost_usd", "revenue_usd"} <= set(payload["hourly"][0])
    assert json.loads((tmp_path / "result.json").read_text())["cost_usd"] == payload["cost_usd"]
    assert (tmp_path / "hourly.csv").read_text().startswith("hour,nodes")
    assert (tmp_path / "requests.npz").stat().st_size > 0
    assert payload["itl_s"]["p50"] <= payload["itl_s"]["p99"]
    assert result.stderr == ""  # no progress bar when not a TTY


def test_simulate_trace_replay_with_skip_bad(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": i * 50, "input_length": 2000 + i, "output_length": 50})
        for i in range(200)
    ]
    lines.insert(7, "{broken")
    trace.write_text("\n".join(lines) + "\n")
    bad = cli("simulate", "--workload", str(trace), "--json")
    assert bad.returncode == 2
    assert "trace.jsonl:8:" in bad.stderr and "Traceback" not in bad.stderr
    good = cli("simulate", "--workload", str(trace), "--skip-bad", "--json")
    assert good.returncode == 0, good.stderr
    payload = json.loads(good.stdout)
    assert payload["bad_lines_skipped"] == 1
    assert payload["requests"]["arrived"] == 200
    assert "skipped 1 bad line" in good.stderr


def test_plan_json(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["timestamp,input_tokens,output_tokens"] + [
        f"{i * 0.05:.2f},{1500 + (i * 37) % 3000},{100 + (i * 13) % 400}" for i in range(4000)
    ]
    trace.write_text("\n".join(rows) + "\n")
    result = cli(
        "plan", "--workload", str(trace), "--slo-ttft-p95", "2s", "--slo-tpot", "50ms", "--json"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["prefill"]["meets_slo"] and payload["decode"]["meets_slo"]
    assert payload["decode"]["tpot_p95_s"] <= 0.05
    assert payload["prefill"]["ttft_p95_s"] <= 2.0
    for phase in ("prefill", "decode", "colocated"):
        cheapest = min(
            (o["cost_usd"] for o in payload["options"] if o["phase"] == phase and o["meets_slo"]),
            default=None,
        )
        assert (payload[phase] or {}).get("cost_usd") == cheapest
    # the chosen kind of fleet is the cheaper one (an aggregated one may meet no SLO)
    disaggregated = payload["prefill"]["cost_usd"] + payload["decode"]["cost_usd"]
    aggregated = (payload["colocated"] or {}).get("cost_usd", float("inf"))
    assert payload["cost_usd"] == min(disaggregated, aggregated)
    assert payload["mode"] == ("aggregated" if aggregated < disaggregated else "disaggregated")


def test_model_json_and_table():
    result = cli("model", "--phase", "decode", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["gpus"] == 144 and len(payload["layers"]) == 61
    layer = payload["layers"][10]
    assert layer["layer_ms"] >= max(layer["compute_ms"], layer["comm_ms"]) - 1e-9
    table = cli("model", "--phase", "prefill")
    assert table.returncode == 0 and "MoE x58" in table.stdout
    bad = cli("model", "--phase", "train")
    assert bad.returncode == 2 and "--phase" in bad.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hardware", "a100"], "error: hardware='a100'"),
        (["--target", "0.8"], "error: target=0.8: only with fleet='auto'"),
        (["--fleet", "auto", "--target", "1.5"], "error: target=1.5 must be in (0, 1]"),
        (["--fleet", "auto", "--block", "3-1"], "error: --block='3-1' must be P:D"),
        (["--fleet", "auto", "--slo-tpot", "fast"], "error: --slo-tpot='fast' must be a duration"),
        (["--fleet", "auto", "--slo-tpot", "1ms"], "error: slo_tpot_s=0.001 is below"),
        (["--slo-ttft-p95", "2s"], "error: slo_ttft_s=2.0: only with fleet='auto'"),
        (["--fleet", "auto", "--slo-ttft-p95", "10ms"], "error: slo_ttft_s=0.01 is not above"),
        (["--fleet", "auto", "--slo-ttft-p95", "soon"], "error: --slo-ttft-p95='soon' must be"),
        (["--fleet", "6x2"], "error: --fleet='6x2' must be deepseek, auto or P:D"),
        (["--fleet", "0:1"], "error: --fleet='0:1' must be deepseek, auto or P:D"),
        (["--decode-unit", "8:3"], "error: decode unit: routed experts + redundant_experts = 259"),
        (["--prefill-unit", "four"], "error: --prefill-unit='four' must be NODES"),
        (["--gpu-hour-usd", "-1"], "error: --gpu-hour-usd=-1.0 must be a finite number >= 0"),
        (["--gpu-hour-usd", "inf"], "error: --gpu-hour-usd=inf must be a finite number >= 0"),
        (["--scale", "nan"], "error: --scale=nan must be a finite number > 0"),
        (["--demand-scale", "0"], "error: --demand-scale=0.0 must be a finite number > 0"),
    ],
)
def test_bad_options_are_one_line_errors(args, message):
    result = cli("simulate", "--hours", "0.1", *args)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message)
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nodes", "0"], "error: --nodes=0 must be >= 1"),
        (["--batch", "nan"], "error: --batch=nan must be a finite number > 0"),
        (["--batch", "inf"], "error: --batch=inf must be a finite number > 0"),
        (["--kv", "-1"], "error: --kv=-1.0 must be a finite number >= 0"),
        (["--micro-batches", "3"], "error: --micro-batches=3 must be 1 or 2"),
    ],
)
def test_model_refuses_what_it_cannot_model(args, message):
    result = cli("model", *args)
    assert result.returncode == 2
    assert result.stderr.strip() == message


def test_model_fills_a_unit_of_any_size_with_redundant_experts():
    # 8 nodes = 64 GPUs: 256 + 32 slots do not split evenly, 256 + 64 = 5 per GPU do.
    for nodes, slots_per_gpu in ((8, 5), (4, 9), (18, 2), (5, 8)):
        result = cli("model", "--nodes", str(nodes), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["gpus"] == nodes * 8
        redundant = slots_per_gpu * nodes * 8 - 256
        assert redundant >= 32 and redundant - nodes * 8 < 32  # the fewest that fit
    given = cli("model", "--nodes", "8", "--redundant-experts", "32")
    assert given.returncode == 2 and "288 must be a multiple of its 64 GPUs" in given.stderr


def test_demand_scale_multiplies_the_generated_day():
    one, two = (
        json.loads(cli("simulate", "--hours", "0.25", "--json", *extra).stdout)
        for extra in ([], ["--demand-scale", "2"])
    )
    ratio = two["input_tokens"] / one["input_tokens"]
    assert ratio == pytest.approx(2.0, rel=0.05)


def test_parse_duration():
    assert parse_duration_s("2s", "x") == 2.0
    assert parse_duration_s("50ms", "x") == 0.05
    assert parse_duration_s("1.5s", "x") == 1.5
    assert parse_duration_s("200us", "x") == pytest.approx(2e-4)
    assert parse_duration_s("1e-3s", "x") == 1e-3
    assert parse_duration_s("0", "x") == 0.0  # zero needs no unit
    with pytest.raises(InputError, match="--slo"):
        parse_duration_s("fast", "--slo")
    with pytest.raises(InputError, match=r"^--slo-tpot=0.5 needs a unit: 0.5ms or 0.5s"):
        parse_duration_s("0.5", "--slo-tpot")  # a bare number: seconds or milliseconds?


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["simulate", "--fleet", "auto", "--slo-tpot", "50"],
            "error: --slo-tpot=50 needs a unit: 50ms or 50s (units: us, ms, s)",
        ),
        (
            ["simulate", "--fleet", "auto", "--slo-ttft-p95", "2"],
            "error: --slo-ttft-p95=2 needs a unit: 2ms or 2s (units: us, ms, s)",
        ),
        (["simulate", "--tick", "2"], "error: --tick=2 needs a unit: 2ms or 2s"),
        (["plan", "--workload", "w.jsonl", "--slo-tpot", "50"], "error: --slo-tpot=50 needs a unit"),
        (["up", "--drain-timeout", "30"], "error: --drain-timeout=30 needs a unit"),
        (["up", "--unit-timeout", "10"], "error: --unit-timeout=10 needs a unit"),
        (["up", "--autoscale-interval", "10"], "error: --autoscale-interval=10 needs a unit"),
        (["unit", "--server", "tcp://h:1", "--role", "decode", "--comm-delay", "0.002"],
         "error: --comm-delay=0.002 needs a unit"),
    ],
)  # fmt: skip
def test_a_duration_without_a_unit_is_refused(tmp_path, args, message):
    (tmp_path / "w.jsonl").write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n')
    result = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["simulate", "--workload", "missing.jsonl"], "error: --workload=missing.jsonl: no such file"),
        (["plan", "--workload", "missing.jsonl"], "error: --workload=missing.jsonl: no such file"),
        (["simulate", "--workload", "folder"], "error: --workload=folder: is a folder, expected a file"),
        (["simulate", "--hours", "0.1", "--out", "w.jsonl"],
         "error: --out=w.jsonl: is a file, expected a folder"),
        (["model", "--calibration", "folder"], "error: --calibration=folder: is a folder"),
        (["calibrate", "--measurements", "missing.json"], "error: --measurements=missing.json: no such file"),
        (["bench", "--workload", "missing.jsonl"], "error: --workload=missing.jsonl: no such file"),
        (["up", "--model", "missing"], "error: --model=missing: no such folder"),
        (["up", "--model", "w.jsonl"], "error: --model=w.jsonl: is a file, expected a folder"),
        (["unit", "--server", "tcp://h:1", "--role", "decode", "--model", "missing"],
         "error: --model=missing: no such folder"),
    ],
)  # fmt: skip
def test_file_options_name_the_option_and_the_problem(tmp_path, args, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "w.jsonl").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_simulate_table_output():
    result = cli("simulate", "--hours", "0.05", "--scale", "1000")
    assert result.returncode == 0, result.stderr
    assert "requests:" in result.stdout and "cost_usd" in result.stdout


def test_simulate_a_fixed_fleet_of_chosen_units_at_my_price():
    result = cli(
        "simulate", "--hours", "0.1", "--fleet", "2:1", "--prefill-unit", "4:32",
        "--decode-unit", "4:32", "--gpu-hour-usd", "3", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["peak_nodes"] == 12 and payload["avg_nodes"] == pytest.approx(12.0)
    assert payload["cost_usd"] == pytest.approx(12 * 0.1 * 8 * 3.0)


def test_model_with_a_shipped_calibration_names_it_and_its_source():
    result = cli(
        "model",
        "--phase",
        "prefill",
        "--prompt-len",
        "1024",
        "--calibration",
        "sglang-h100",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["calibration"]["name"] == "sglang-h100" and doc["hardware"] == "h100"
    assert "lmsys.org" in doc["calibration"]["source"]
    missing = cli("model", "--calibration", "sglang-h200")
    assert missing.returncode == 2
    assert "allowed: none, deepseek-h800, sglang-h100, rtp-llm-h800 or a file" in missing.stderr


def test_model_with_one_micro_batch_exposes_nvlink_where_it_binds():
    """A 3-node prefill unit's all-to-all is NVLink-bound on H800 and RDMA-bound on H100: hidden
    behind computation with two micro-batches (but for the SMs it holds while it runs), it shows
    with one (docs/serving-model.md)."""

    def step_ms(hardware, micro_batches):
        result = cli(
            "model", "--phase", "prefill", "--nodes", "3", "--hardware", hardware,
            "--micro-batches", str(micro_batches), "--calibration", "none", "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        payload = json.loads(result.stdout)
        assert payload["micro_batches"] == micro_batches
        return payload["step_ms"]

    assert step_ms("h100", 2) == pytest.approx(step_ms("h800", 2), rel=0.02)
    assert step_ms("h100", 1) == pytest.approx(step_ms("h800", 1) * 0.94, rel=0.02)


@pytest.mark.parametrize(
    "args,message",
    [
        (["simulate", "--model", "deepseek-v5"],
         "error: --model='deepseek-v5' is not one of deepseek-v3, deepseek-v3.2"),
        (["plan", "--model", "deepseek-v4"],
         "error: --model='deepseek-v4' is not one of deepseek-v3, deepseek-v3.2"),
        (["model", "--model", "v3.2"], "error: --model='v3.2' is not one of deepseek-v3, "),
        (["frontier", "--model", "deepseek-v5"], "error: --model='deepseek-v5' is not one of "),
        (["simulate", "--kv-cache-dtype", "fp4"],
         "error: --kv-cache-dtype='fp4' is not one of bf16, fp8"),
        (["plan", "--model", "deepseek-v3.2", "--kv-cache-dtype", "int8"],
         "error: --kv-cache-dtype='int8' is not one of bf16, fp8"),
        (["position-cost", "--kv-cache-dtype", "fp4"],
         "error: --kv-cache-dtype='fp4' is not one of bf16, fp8"),
        (["position-cost", "--mtp", "1.5"], "error: --mtp-acceptance=1.5 must be a number in [0, 1)"),
    ],
)  # fmt: skip
def test_a_bad_model_is_one_line_naming_the_option_and_what_is_allowed(args, message):
    result = cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_simulate_without_model_is_deepseek_v3_and_v32_is_chosen_by_name():
    default = json.loads(cli("simulate", "--hours", "0.05", "--scale", "1000", "--json").stdout)
    named = cli(
        "simulate", "--hours", "0.05", "--scale", "1000", "--json",
        "--model", "deepseek-v3", "--kv-cache-dtype", "bf16",
    )  # fmt: skip
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout)["cost_usd"] == default["cost_usd"]
    assert json.loads(named.stdout)["tpot_s"] == default["tpot_s"]
    assert default["model"]["name"] == "deepseek-v3"
    assert default["model"]["kv_bytes_per_token"] == 70_272
    v32 = cli("simulate", "--hours", "0.05", "--scale", "1000", "--model", "deepseek-v3.2")
    assert v32.returncode == 0, v32.stderr
    assert "model deepseek-v3.2: sparse attention" in v32.stdout
    assert "85,888 bytes per token" in v32.stdout


def test_model_and_frontier_take_the_architecture():
    result = cli("model", "--model", "deepseek-v3.2", "--kv", "65536", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["model"] == {
        "name": "deepseek-v3.2",
        "kv_cache_dtype": "bf16",
        "kv_bytes_per_token": 85_888,
        "sparse_attention": True,
    }
    assert doc["layers"][10]["indexer"] > doc["layers"][10]["core_attn"] > 0
    assert doc["memory_gb_per_gpu"]["kv_one_full_context_request"] == pytest.approx(
        131_072 * 85_888 / 1e9
    )
    table = cli("model", "--model", "deepseek-v3.2", "--phase", "prefill")
    assert table.returncode == 0 and "│ indexer" in table.stdout
    front = cli(
        "frontier", "--model", "deepseek-v3.2", "--kv-cache-dtype", "fp8", "--nodes", "18",
        "--kv", "32768", "--json",
    )  # fmt: skip
    assert front.returncode == 0, front.stderr
    assert json.loads(front.stdout)["model"]["kv_bytes_per_token"] == 48_068


def test_plan_a_long_context_workload_under_v3_and_v32():
    """64K-token prompts (DeepSeek's cache-hit share), 1K answers, 100K output tokens/s for 15
    minutes: V3.2 needs well under half of V3's nodes, nearly all of the saving in prefill."""

    def plan(model):
        result = cli(
            "plan", "--demand", "100000", "--lengths", "64000:1000", "--hours", "0.25",
            "--scale", "20", "--micro-batches", "2", "--modes", "disaggregated",
            "--model", model, "--calibration", "none", "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    v3, v32 = plan("deepseek-v3"), plan("deepseek-v3.2")
    assert v3["model"]["name"] == "deepseek-v3" and v32["model"]["name"] == "deepseek-v3.2"
    assert v32["cost_usd"] < 0.6 * v3["cost_usd"]
    assert v32["prefill"]["total_nodes"] < 0.6 * v3["prefill"]["total_nodes"]


def test_position_cost_against_the_published_curve():
    result = cli("position-cost", "--mtp", "0.85", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert "DeepSeek-V3.2-Exp" in doc["published_source"]["url"]
    decode = doc["usd_per_million_tokens"]["decode"]
    at = decode["positions_k"].index(128.0)
    assert decode["model_over_published"][at] == pytest.approx(1.0, abs=0.1)
    table = cli("position-cost")
    assert table.returncode == 0, table.stderr
    assert "model against published" in table.stdout and "128K" in table.stdout


def test_every_number_serve_prints_for_people_follows_the_one_rule(tmp_path):
    """simulate (calibrated, with its ranges, and not), a replay with refusals, plan, model,
    frontier and position-cost print every number as moeinfra.numfmt.format_number does (issue
    #40): no 0.1000, 1574.3 or 606.8B; the JSON keeps raw numbers."""
    import os

    from tests.test_cli_main import assert_numbers_follow_the_rule

    trace = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"timestamp": i * 40, "input_length": 900 + 7 * i, "output_length": 30 + i})
        for i in range(60)
    ]
    lines.append(json.dumps({"timestamp": 2500, "input_length": 131_000, "output_length": 100}))
    trace.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, COLUMNS="250")  # wide: rich folds no number across lines
    runs = [
        ["simulate", "--hours", "0.05", "--scale", "1000"],
        ["simulate", "--hours", "0.05", "--scale", "1000", "--calibration", "none"],
        ["simulate", "--workload", str(trace)],
        ["plan", "--demand", "20000", "--hours", "0.05", "--modes", "disaggregated",
         "--prefill-nodes", "4", "--decode-nodes", "4,18", "--micro-batches", "2"],
        ["model", "--phase", "prefill"],
        ["model", "--calibration", "none"],
        ["frontier", "--nodes", "8,18"],
        ["position-cost"],
    ]  # fmt: skip
    text = ""
    for args in runs:
        done = subprocess.run(
            [sys.executable, "-m", "moeinfra.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, (args, done.stderr)
        text += done.stdout.replace(str(tmp_path), "")
    assert "(context: 1)" in text and "range (calibration" in text
    assert assert_numbers_follow_the_rule(text) > 300
