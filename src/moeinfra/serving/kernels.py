"""Measured kernel times in place of the first-principles ones (``serve model --kernels aiconfigurator``).

NVIDIA's AIConfigurator (``pip install moeinfra[aic]``: ``aiconfigurator-core==0.12.0``,
Apache-2.0) ships per-operation latencies measured with SGLang on H100 and H200. Three of its tables
cover parts of a DeepSeek-V3 layer exactly as this model splits it, and are read here (from the
installed package's data, without importing it):

* DeepEP normal all-to-all (prefill's dispatch and combine), by nodes and tokens per GPU;
* DeepEP low-latency all-to-all (decode's), by nodes and tokens per GPU;
* the grouped MoE GEMMs of DeepEP's MoE block (prefill and decode), by EP degree and tokens, with
  uniform routing — the measured stand-in for an EPLB-balanced load (the unit's EPLB imbalance is
  applied on top, as in the first-principles model).

A part is then *measured* (a measured point), *interpolated* (linear in tokens between the two
measured points around it) or *first-principles* — with the reason: no table for the unit's node
count or EP degree, another model shape, or tokens outside the measured range. Nothing is
extrapolated. Every other part (MLA projections and attention, shared expert, gate, dense MLPs)
stays first-principles.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from moeinfra.errors import InputError

KERNEL_SOURCES = ("first-principles", "aiconfigurator")
#: moeinfra hardware preset -> AIConfigurator system with the wide-EP SGLang tables.
AIC_SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm"}
AIC_FILES = {
    "deepep_normal": "comm/sglang/0.5.6.post2/wideep_deepep_normal_perf.parquet",
    "deepep_low_latency": "comm/sglang/0.5.6.post2/wideep_deepep_ll_perf.parquet",
    "moe_prefill": "moe/sglang/0.5.10/wideep_context_moe_perf.parquet",
    "moe_decode": "moe/sglang/0.5.10/wideep_generation_moe_perf.parquet",
}
#: SMs DeepSeek gives the prefill all-to-all (24 of 132); a table without them takes the most it has.
PREFILL_COMM_SMS = 24


@dataclass(frozen=True)
class OpTime:
    """Seconds of one part of a layer and where they come from."""

    seconds: float
    source: str  # "measured", "interpolated" or "first-principles"
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.source} ({self.note})" if self.note else self.source


@dataclass(frozen=True)
class Curve:
    """Measured seconds of one kernel against tokens per GPU (sorted, distinct)."""

    tokens: np.ndarray
    seconds: np.ndarray
    what: str

    def at(self, tokens: float, first_principles: float) -> OpTime:
        lo, hi = float(self.tokens[0]), float(self.tokens[-1])
        hit = np.isclose(self.tokens, tokens, rtol=1e-9, atol=0.0)
        if hit.any():
            return OpTime(float(self.seconds[hit.argmax()]), "measured", self.what)
        if lo < tokens < hi:
            return OpTime(
                float(np.interp(tokens, self.tokens, self.seconds)), "interpolated", self.what
            )
        return OpTime(
            first_principles,
            "first-principles",
            f"{tokens:,.0f} tokens per GPU outside the measured {lo:,.0f}-{hi:,.0f}: {self.what}",
        )

    def seconds_at(self, tokens, first_principles):
        """:meth:`at` over arrays, seconds only: measured or interpolated within the measured
        tokens, ``first_principles`` (broadcast) outside them."""
        t = np.asarray(tokens, dtype=np.float64)
        inside = (t >= self.tokens[0]) & (t <= self.tokens[-1])
        return np.where(inside, np.interp(t, self.tokens, self.seconds), first_principles)

    def covers(self) -> str:
        """Where this curve applies: the measured tokens per GPU and what was measured."""
        lo, hi = (f"{t:,.0f}" if t >= 1 else f"{t:.3g}" for t in (self.tokens[0], self.tokens[-1]))
        return f"{lo}-{hi} tokens per GPU: {self.what}"


@dataclass(frozen=True)
class KernelTables:
    """Measured kernel curves of one system. ``rows[table]``: dicts with the columns of
    AIConfigurator's tables (names as in its Parquet files)."""

    system: str
    rows: dict[str, list[dict]] = field(repr=False)

    @classmethod
    def aiconfigurator(cls, hardware: str, data_dir: Path | None = None) -> KernelTables:
        """The tables of the installed ``aiconfigurator-core`` for ``hardware`` (h100 or h200)."""
        if hardware not in AIC_SYSTEMS:
            raise InputError(
                f"--kernels aiconfigurator: --hardware={hardware!r} has no AIConfigurator wide-EP "
                f"tables; allowed: {', '.join(AIC_SYSTEMS)}"
            )
        root = data_dir or _aic_data_dir()
        system = AIC_SYSTEMS[hardware]
        paths = {table: root / system / rel for table, rel in AIC_FILES.items()}
        for path in paths.values():
            if not path.is_file():
                raise InputError(f"--kernels aiconfigurator: {path} is missing")
        import pyarrow.parquet as pq  # a dependency of aiconfigurator-core

        rows = {table: pq.read_table(path).to_pylist() for table, path in paths.items()}
        return cls(system, rows)

    def _rows(self, table: str, shape: dict[str, int], **match) -> list[dict]:
        return [
            r
            for r in self.rows.get(table, [])
            if all(r[k] == v for k, v in (shape | match).items())
        ]

    def all_to_all(
        self, kernel: str, nodes: int, shape: dict[str, int]
    ) -> tuple[Curve, Curve] | None:
        """(dispatch, combine) curves of DeepEP's ``"normal"`` or ``"low_latency"`` kernels on
        ``nodes`` nodes, or None when none was measured."""
        shape = {
            "hidden_size": shape["hidden"],
            "num_topk": shape["topk"],
            "num_experts": shape["experts"],
        }
        if kernel == "normal":
            rows = self._rows("deepep_normal", shape, node_num=nodes)
            sms = {r["dispatch_sms"] for r in rows}
            use = PREFILL_COMM_SMS if PREFILL_COMM_SMS in sms else max(sms, default=0)
            rows = [r for r in rows if r["dispatch_sms"] == use and r["combine_sms"] == use]
            if not rows:
                return None
            what = f"DeepEP normal, {nodes} node(s), {use} SMs, {_measured_on(rows, self.system)}"
            times = [
                (r["num_token"], r["dispatch_transmit_us"] + r["dispatch_notify_us"],
                 r["combine_transmit_us"] + r["combine_notify_us"])
                for r in rows
            ]  # fmt: skip
        else:
            rows = self._rows("deepep_low_latency", shape, node_num=nodes)
            if not rows:
                return None
            what = f"DeepEP low-latency, {nodes} node(s), {_measured_on(rows, self.system)}"
            times = [(r["num_token"], r["dispatch_avg_t_us"], r["combine_avg_t_us"]) for r in rows]
        return _curve(times, 1, what), _curve(times, 2, what)

    def routed_experts(self, phase: str, ep: int, shape: dict[str, int]) -> Curve | None:
        """Grouped MoE GEMMs of one GPU against its tokens per GPU (the tables count tokens over
        all ``ep`` GPUs), uniform routing, or None when EP ``ep`` was not measured."""
        table = "moe_prefill" if phase == "prefill" else "moe_decode"
        rows = self._rows(
            table,
            {"hidden_size": shape["hidden"], "topk": shape["topk"], "num_experts": shape["experts"],
             "inter_size": shape["inter"]},
            moe_ep_size=ep,
            distribution="uniform",
        )  # fmt: skip
        if not rows:
            return None
        what = f"grouped MoE GEMMs, EP{ep}, uniform routing, {_measured_on(rows, self.system)}"
        times = [(r["num_tokens"] / ep, r["latency"] * 1e3) for r in rows]
        return _curve(times, 1, what)

    def moe_parts(
        self,
        phase: str,
        nodes: int,
        gpus: int,
        shape: dict[str, int],
        *,
        heaviest_tokens: float,
        sm_fraction: float,
        first_principles: dict[str, float],
    ) -> dict[str, OpTime]:
        """Routed experts, dispatch and combine of one micro-batch of a ``phase`` unit (``nodes``
        nodes, ``gpus`` GPUs) whose heaviest GPU handles ``heaviest_tokens``: measured or
        interpolated where a table covers it, else ``first_principles[part]`` with the reason."""
        out: dict[str, OpTime] = {}
        first = float(first_principles["routed"])
        curve, curves = self.moe_curves(phase, nodes, gpus, shape)
        kernel = "normal" if phase == "prefill" else "low_latency"
        if curve is None:
            out["routed"] = OpTime(first, "first-principles", f"no measured EP{gpus} MoE")
        else:
            # measured on all SMs; in the step the experts run on their share of the SMs
            at = curve.at(heaviest_tokens, first * sm_fraction)
            out["routed"] = replace(at, seconds=at.seconds / sm_fraction)
        for i, name in enumerate(("dispatch", "combine")):
            first = float(first_principles[name])
            if gpus == 1:
                out[name] = OpTime(first, "first-principles", "one GPU: no all-to-all")
            elif curves is None:
                what = kernel.replace("_", "-")
                out[name] = OpTime(
                    first, "first-principles", f"no measured {nodes}-node DeepEP {what}"
                )
            else:
                out[name] = curves[i].at(heaviest_tokens, first)
        return out

    def moe_curves(
        self, phase: str, nodes: int, gpus: int, shape: dict[str, int]
    ) -> tuple[Curve | None, tuple[Curve, Curve] | None]:
        """The routed-expert curve and the (dispatch, combine) curves of a ``phase`` unit, each
        None where nothing was measured (no all-to-all on one GPU)."""
        kernel = "normal" if phase == "prefill" else "low_latency"
        a2a = self.all_to_all(kernel, nodes, shape) if gpus > 1 else None
        return self.routed_experts(phase, gpus, shape), a2a


def _measured_on(rows: list[dict], system: str) -> str:
    """The devices the rows were measured on, as the table records them (AIConfigurator fills a
    system's gaps with other devices' rows), and the table's system."""
    devices = sorted({str(r.get("device", "?")) for r in rows})
    return f"{' / '.join(devices)} ({system} table)"


def _curve(times: list[tuple], column: int, what: str) -> Curve:
    """A curve from (tokens, µs...) tuples; repeated token counts keep their mean."""
    by_tokens: dict[float, list[float]] = {}
    for row in times:
        by_tokens.setdefault(float(row[0]), []).append(float(row[column]))
    tokens = np.array(sorted(by_tokens))
    return Curve(tokens, np.array([np.mean(by_tokens[t]) * 1e-6 for t in tokens]), what)


def _aic_data_dir() -> Path:
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "--kernels aiconfigurator needs NVIDIA's AIConfigurator tables: "
            "pip install 'moeinfra[aic]' (aiconfigurator-core==0.12.0)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "systems" / "data"
