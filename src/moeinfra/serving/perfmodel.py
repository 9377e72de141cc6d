"""Per-layer, per-step time of a prefill or decode unit (formulas in docs/serving-model.md).

Every operation is a roofline: ``max(FLOPs / (peak * efficiency), bytes / (bandwidth * efficiency))``.
A layer runs two micro-batches; it costs ``max(compute path, communication path)`` (dual micro-batch
overlap in prefill, the 5-stage pipeline in decode), plus the non-overlapped head. The routed-expert
GEMMs and the dispatch/combine receive volume are multiplied by the EPLB expert imbalance of the unit.

The achieved-efficiency factors in :class:`Efficiency` are few, derived from DeepSeek's published kernel
figures, and shared by every scenario.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving import deepep
from moeinfra.serving.arch import CSA
from moeinfra.serving.kernels import KernelTables
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    FP4_BYTES_PER_WEIGHT,
    Deployment,
    ExpertBalance,
    HardwareSpec,
    ModelSpec,
    expert_balance,
)

DISPATCH_BYTES_PER_TOKEN = 7_392  # 7,168 FP8 values + 56 float32 scales, per destination
COMBINE_BYTES_PER_TOKEN = 14_336  # 7,168 BF16 values, per destination


def token_bytes(hidden: int) -> tuple[int, int]:
    """(dispatch, combine) bytes of one token row per destination for a model of ``hidden``
    dimensions: FP8 values with a float32 scale per 128, and BF16 values (V3's 7,168: 7,392 and
    14,336; V4-Flash's 4,096: 4,224 and 8,192)."""
    return hidden + 4 * (hidden // 128), 2 * hidden


#: FP8 TFLOPS DeepGEMM published for DeepSeek-V3's GEMM shapes on H800 (README, 2025-02), by rows
#: (per group for the grouped MoE kernels). Roles: MLA down-projections (q_a + kv_a, N=2112,
#: K=7168), q up-projection (24576 x 1536), kv up-projection (32768 x 512), output projection
#: (7168 x 16384), expert gate+up (4096 x 7168) and down (7168 x 2048) as plain GEMMs (shared
#: expert), contiguous grouped (prefill) and masked grouped (decode).
DEEPGEMM_H800_TFLOPS: dict[str, dict[int, float]] = {
    "mla_down": {64: 206.0, 128: 352.0, 4096: 1058.0},
    "q_up": {64: 289.0, 128: 535.0, 4096: 990.0},
    "kv_up": {64: 219.0, 128: 358.0, 4096: 590.0},
    "attn_out": {64: 336.0, 128: 645.0, 4096: 1358.0},
    "expert_up": {64: 287.0, 128: 533.0, 4096: 1304.0},
    "expert_down": {64: 295.0, 128: 510.0, 4096: 1025.0},
    "expert_up_contiguous": {4096: 1288.0, 8192: 1297.0},
    "expert_down_contiguous": {4096: 1093.0, 8192: 1099.0},
    "expert_up_masked": {256: 932.0, 512: 1040.0, 1024: 1233.0},
    "expert_down_masked": {256: 815.0, 512: 916.0, 1024: 925.0},
}
H800_FP8_TFLOPS = 1979.0
_GROUPED = ("_contiguous", "_masked")

#: DeepSeek's own kernel for MLA's MHA mode (128 heads, q.k over 192 dimensions, v 128; V3's and
#: V3.1's prefill, per the V3.2-Exp report's appendix), as DeepSeek's published H800 training
#: profile times it (github.com/deepseek-ai/profile-data ``train.json``, shipped as
#: ``examples/data/deepseek_train_trace.json``): four causal forward calls over one 4,096-token
#: sequence (``flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128, 128, ...>>``, a
#: FlashAttention-3 kernel), 1,248 / 1,199 / 1,280 / 1,221 us, each beside a DeepEP dispatch that
#: holds 20 of the 132 SMs (20 blocks; an attention block's 384 threads x 168 registers fill an
#: SM's register file, so the two never share an SM). FLOPs of one call and its mean seconds:
MHA_TRACE_FLOPS = 2 * 128 * (192 + 128) * 4096 * 4097 / 2
MHA_TRACE_SECONDS = (1248 + 1199 + 1280 + 1221) / 4 * 1e-6
MHA_TRACE_SMS = 132 - 20
#: -> 556 TFLOPS on 112 SMs: 0.662 of the BF16 peak of the SMs it ran on.
MHA_PREFILL_SHARE = MHA_TRACE_FLOPS / MHA_TRACE_SECONDS / (989e12 * MHA_TRACE_SMS / 132)


def _rows_table(role: str, tables: dict[str, dict[int, float]]) -> dict[int, float]:
    """TFLOPS by rows for ``role``; a grouped kernel's table is extended below its smallest
    published rows per expert by the plain GEMM of the same shape (DeepGEMM publishes the grouped
    kernels at 256+ rows per expert only)."""
    table = dict(tables[role])
    for suffix in _GROUPED:
        if role.endswith(suffix) and role.removesuffix(suffix) in tables:
            smallest = min(table)
            plain = tables[role.removesuffix(suffix)]
            table.update({m: v for m, v in plain.items() if m < smallest})
    return table


def _interp_ep(table: dict[int, float], ep: int) -> float:
    """Value of a table keyed by EP degree at ``ep`` (log-linear between keys, clamped outside)."""
    keys = np.array(sorted(table), dtype=np.float64)
    values = np.array([table[int(k)] for k in keys])
    return float(np.interp(np.log2(ep), np.log2(keys), values))


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak, each from a published kernel figure on H800 (see docs).

    gemm_tflops: DeepGEMM's published FP8 TFLOPS on H800 per GEMM role and row count
        (``DEEPGEMM_H800_TFLOPS``), used as a fraction of the FP8 peak for the MLA projections and
        the expert GEMMs; grouped kernels below their published rows per expert take the plain
        GEMM's figures, and fewer rows than 64 cost as many as 64 (bound by reading the weights).
    gemm: DeepGEMM up to 1,350 of 1,979 FP8 TFLOPS -> 0.682, for the GEMMs the table does not
        list (MoE gate, dense MLPs of the first layers, LM head), with the HBM roofline.
    attention_compute: FlashMLA 580 of 989 BF16 TFLOPS -> 0.586 (dense decoding: MLA's MQA mode).
    mha_prefill_compute: MLA's MHA mode in prefill (V3's dense prefill, V3.2's masked MHA mode):
        DeepSeek's FlashAttention-3 kernel at 0.662 of the BF16 peak of the SMs it runs on, timed
        in DeepSeek's H800 training profile (:data:`MHA_PREFILL_SHARE`).
    sparse_prefill_compute / sparse_decode_compute: FlashMLA's token-level sparse kernels (MLA's
        MQA mode over the keys DeepSeek Sparse Attention selects), 640 and 410 of 989 BF16 TFLOPS
        on H800 (README, 2025-09-29; the decode kernel reads an FP8 cache) -> 0.647 / 0.415.
    memory: FlashMLA 3,000 of 3,350 GB/s -> 0.896 (all HBM-bound reads).
    nvlink: DeepEP intranode 153 of 160 GB/s -> 0.956.
    prefill_compute_sms: 108 of 132 SMs compute while 24 run the all-to-all (prefill only). The
        GEMMs (DeepGEMM's persistent kernels, the indexer's logits among them) are launched on
        that share for the whole step — DeepSeek's profile launches them on 112 = 132 - 20 SMs
        beside its 20-SM all-to-all; the attention kernels (a block per tile: FlashAttention's,
        FlashMLA's sparse prefill) take every SM the all-to-all does not hold, so the share
        slows them only while the all-to-all runs (:meth:`PerfModel._beside_all_to_all`).
    rdma_normal / nvlink_normal: (dispatch, combine) shares of the NIC's and of NVLink's bandwidth
        DeepEP's normal kernels achieve across nodes, derived from DeepEP's published H800 figures
        (:mod:`moeinfra.serving.deepep`); a kernel takes the longer of its RDMA and NVLink stages.
    ll_latency_us_128: DeepEP low-latency kernels (dispatch, combine) for 128 tokens by EP degree;
        scaled by NIC speed.
    ll_fixed_share: (dispatch, combine) share of the 128-token low-latency time that does not shrink
        with fewer tokens; ``t(n) = t_128 * (share + (1 - share) * n / 128)``: a line through
        DeepEP's low-latency kernels measured at 16 and 128 tokens per GPU on 8 H100 nodes by
        NVIDIA's AIConfigurator (:func:`moeinfra.serving.deepep.ll_fixed_share`).
    comm_launch_s: fixed cost of one normal-kernel all-to-all call (kernel launch + RDMA round trip).
    ll_wait_s: seconds added to every low-latency dispatch and combine call, whatever its tokens:
        in a running system the ranks of an all-to-all wait for each other (0 in the
        first-principles model; fitted by a calibration).
    step_overhead_s: per forward step, host-side scheduling plus kernel-launch gaps: ~1.5 ms + ~2 ms
        measured by Alibaba's RTP-LLM on H800 in DeepSeek's EP144 decode configuration.
    memory_usable: share of HBM usable for weights + KV cache (the rest: activations, buffers).
    gemm_time / attention_time / decode_attention_time / comm_time: multipliers on the modelled
        GEMM (projections, experts, gate, dense MLPs, LM head), prefill core-attention, decode
        core-attention and all-to-all (bandwidth and low-latency) times; 1 in the first-principles
        model, fitted by a calibration (:mod:`moeinfra.serving.calibration`). Prefill and decode
        attention are different kernels (prefill: multi-head attention over the prompt,
        compute-bound; decode: MLA's absorbed form over the latent cache, near HBM-bound), so one
        factor fitted to one does not carry to the other.
    request_overhead_s: seconds a request spends outside the units before its first token (API
        server, router, transport); 0 in the first-principles model, measured by a live calibration.
    prefill_contention / decode_contention: share by which a prefill / decode step slows while
        another unit computes on the same host's cores, ``t * (1 + c * overlap)`` (a live
        calibration of units sharing one CPU host; a decode step, a chain of small all-to-alls,
        waits on every descheduled peer); 0 for units that have their own GPUs.
    prompt_overhead_s: host seconds per prompt finishing in a prefill step, beyond its LM-head row
        (first-token sampling and detokenisation, packing its KV for the hand-off); 0 in the
        first-principles model, fitted by a live calibration.
    decode_interrupt_s: seconds a decode unit on the same host loses each time a prefill step
        starts or ends (the prefill unit's host work around its step: scheduling, hand-off,
        detokenisation); 0 for units that have their own GPUs.
    prefill_step_jitter: quantiles, at evenly spaced probabilities from 0 to 1, of a prefill
        step's time over the median of like steps (same tokens, keys and contention); the
        simulator draws every step's time from them (a step's first tokens wait for its slowest
        rank, so a slow step is a TTFT tail). Empty in the first-principles model (every step its
        modelled time), measured by a live calibration.
    """

    gemm_tflops: dict[str, dict[int, float]] = field(
        default_factory=lambda: {k: dict(v) for k, v in DEEPGEMM_H800_TFLOPS.items()}
    )
    gemm: float = 1350.0 / 1979.0
    attention_compute: float = 580.0 / 989.0
    mha_prefill_compute: float = MHA_PREFILL_SHARE
    sparse_prefill_compute: float = 640.0 / 989.0
    sparse_decode_compute: float = 410.0 / 989.0
    memory: float = 3000.0 / 3350.0
    nvlink: float = 153.0 / 160.0
    prefill_compute_sms: float = 108.0 / 132.0
    rdma_normal: tuple[float, float] = field(default_factory=lambda: deepep.derived_efficiency()[0])
    nvlink_normal: tuple[float, float] = field(
        default_factory=lambda: deepep.derived_efficiency()[1]
    )
    ll_latency_us_128: dict[int, tuple[float, float]] = field(
        default_factory=lambda: {
            8: (77.0, 114.0),
            16: (118.0, 195.0),
            32: (155.0, 273.0),
            64: (173.0, 314.0),
            128: (192.0, 369.0),
            256: (194.0, 360.0),
        }
    )
    ll_fixed_share: tuple[float, float] = field(default_factory=deepep.ll_fixed_share)
    comm_launch_s: float = 10e-6
    ll_wait_s: float = 0.0
    step_overhead_s: float = 3.5e-3
    memory_usable: float = 0.9
    gemm_time: float = 1.0
    attention_time: float = 1.0
    decode_attention_time: float = 1.0
    comm_time: float = 1.0
    request_overhead_s: float = 0.0
    prefill_contention: float = 0.0
    decode_contention: float = 0.0
    decode_interrupt_s: float = 0.0
    prompt_overhead_s: float = 0.0
    prefill_step_jitter: tuple[float, ...] = ()

    def __hash__(self) -> int:  # the dict fields are not hashable; the repr holds every value
        return hash(repr(self))

    def scaled(self, k: float) -> Efficiency:
        """Every modelled step time ``k`` times as long: each of :data:`TIME_TERMS` x ``k``."""
        if not (np.isfinite(k) and k > 0):
            raise InputError(f"time scale k={k} must be a finite number > 0")
        return replace(self, **{term: getattr(self, term) * k for term in TIME_TERMS})


#: The :class:`Efficiency` fields that are times (multipliers on modelled times, or seconds).
#: Every other field is a rate or a share, and a step is a sum and maximum of terms each scaled
#: by one of these, so scaling them all by k scales every step by k.
TIME_TERMS = (
    "gemm_time",
    "attention_time",
    "decode_attention_time",
    "comm_time",
    "comm_launch_s",
    "ll_wait_s",
    "step_overhead_s",
    "prompt_overhead_s",
    "decode_interrupt_s",
)

DEFAULT_EFFICIENCY = Efficiency()

PARTS = ("attn_proj", "core_attn", "shared", "routed", "gate", "dense_mlp", "dispatch", "combine")
#: The part a sparse-attention model adds (DeepSeek-V3.2's lightning indexer: its projections, the
#: FP8 logits of every query against every earlier index key, the top-k over them).
INDEXER = "indexer"


@dataclass(frozen=True)
class LayerBreakdown:
    """Per-layer seconds of one step, per part (``parts[name]`` is ``[layers]``: :data:`PARTS`, and
    :data:`INDEXER` for a sparse-attention model), and totals.

    ``compute`` / ``comm``: ``[layers]`` sums over both micro-batches; ``layer``: max of the two;
    ``step_s``: sum over layers plus ``head_s`` plus ``overhead_s`` (host and launch gaps).
    ``tokens``: tokens the unit processes in the step. ``sources``: where each MoE part's time
    comes from when measured kernels are in force (:mod:`moeinfra.serving.kernels`; empty: every
    part first-principles).
    """

    phase: str
    parts: dict[str, np.ndarray]
    compute: np.ndarray
    comm: np.ndarray
    layer: np.ndarray
    head_s: float
    overhead_s: float
    step_s: float
    tokens_per_gpu: float
    sources: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[dict[str, float]]:
        """One dict per layer (milliseconds) for tables and JSON."""
        out = []
        for i in range(self.layer.size):
            row = {"layer": i}
            row.update({name: float(v[i]) * 1e3 for name, v in self.parts.items()})
            row.update(
                compute_ms=float(self.compute[i]) * 1e3,
                comm_ms=float(self.comm[i]) * 1e3,
                layer_ms=float(self.layer[i]) * 1e3,
            )
            out.append(row)
        return out


def _overlapped(mb: int, attention, mlp, dispatch, combine):
    """Seconds of one MoE layer with ``mb`` micro-batches (per-micro-batch inputs, broadcastable).

    With two micro-batches each all-to-all of one hides behind a compute segment of the other:
    its dispatch behind the other's expert MLPs (shared + routed), its combine behind the other's
    attention (projections, core attention, gate), so the layer costs
    ``2 * (max(mlp, dispatch) + max(attention, combine))`` — the max of the compute and
    communication paths plus what does not fit in its window. One micro-batch overlaps nothing.
    """
    if mb == 1:
        return attention + mlp + dispatch + combine
    return mb * (np.maximum(mlp, dispatch) + np.maximum(attention, combine))


#: What the DeepSeek-V4 model assumes rather than takes from a published kernel figure (also in
#: docs/serving-model.md, "DeepSeek-V4 in the performance model").
V4_ASSUMPTIONS = (
    "core attention at FlashMLA's sparse kernels' H800 rates (410 TFLOPS decode, 640 prefill), "
    "the kernels vLLM runs V4 on; their V4 figures are not published",
    "the indexer's FP4 logits at the FP8 GEMM rate (Hopper has no FP4 tensor cores)",
    "V4's projections, compressors, mHC and FP4xFP8 experts at the FP8 roofline with DeepGEMM's "
    "1,350 TFLOPS share (its published table holds V3's shapes only)",
    "DeepEP's low-latency times scaled by the hidden size over V3's 7,168",
)

#: DeepSeek-V3's served context: one request of this many tokens must fit on one GPU (its KV cache
#: lives on the data-parallel attention rank that holds it, in prefill and in decode).
MAX_CONTEXT_TOKENS = 131_072
#: Decode requests per GPU the activation estimate is made for: the largest published for
#: DeepSeek-V3 decode (LMSYS/SGLang, 256 per GPU; DeepSeek's profile runs 128).
DECODE_ACTIVATION_BATCH = 256


@dataclass(frozen=True)
class MemoryUse:
    """Bytes per GPU a unit needs in HBM: the weights, the activations of one step (both
    micro-batches in flight) and the KV cache of one request at the full context; ``usable``: the
    HBM share usable for them (``Efficiency.memory_usable``)."""

    weights: float
    activations: float
    kv_one_request: float
    usable: float
    hbm: float
    context: int = MAX_CONTEXT_TOKENS

    @property
    def fits(self) -> bool:
        return self.weights + self.activations + self.kv_one_request <= self.usable

    def describe(self) -> str:
        """The budget in words, every number by :func:`moeinfra.numfmt.format_number`."""
        from moeinfra.numfmt import format_number as n

        gb = 1e9
        return (
            f"weights {n(self.weights / gb)} GB + activations {n(self.activations / gb)} GB + "
            f"one {n(self.context)}-token request's KV {n(self.kv_one_request / gb)} GB "
            f"{'<=' if self.fits else '>'} {n(self.usable / gb)} GB usable of "
            f"{n(self.hbm / gb)} GB HBM per GPU"
        )


class PerfModel:
    """Time model of one deployment unit (``dep``) of ``model`` on ``hw``.

    The expert imbalance (EPLB plan on a synthetic skewed load) is computed once here.
    ``kv_tokens_per_gpu`` fixes the KV-cache capacity (an engine's configured blocks) instead of
    deriving it from HBM left after the weights. ``kernels``: measured kernel tables whose
    all-to-all and routed-expert times replace the first-principles ones in
    :meth:`prefill_breakdown` and :meth:`decode_breakdown` where they cover the unit
    (:meth:`decode_step_s`, the simulator's, refuses them).
    """

    def __init__(
        self,
        dep: Deployment,
        hw: HardwareSpec,
        model: ModelSpec = DEEPSEEK_V3,
        eff: Efficiency = DEFAULT_EFFICIENCY,
        *,
        balance: ExpertBalance | None = None,
        kv_tokens_per_gpu: float | None = None,
        kernels: KernelTables | None = None,
    ) -> None:
        self.gpus = dep.gpus(hw)
        self.balance = balance if balance is not None else expert_balance(model, hw, dep)
        # multi-token prediction: the MTP module is one more MoE layer (weights, KV, compute), and
        # a step verifies the draft beside the next token
        self.queries = 2 if dep.mtp_acceptance > 0 else 1
        if self.queries == 2:
            model = replace(model, num_layers=model.num_layers + 1)
        self.dep, self.hw, self.model, self.eff = dep, hw, model, eff
        self.kernels = kernels
        self._kv_tokens_per_gpu = kv_tokens_per_gpu
        # per GEMM role: (log2 rows, achieved FLOP/s on this hardware) from DeepGEMM's H800 table
        self._gemm_tables = {}
        for role in eff.gemm_tflops:
            table = _rows_table(role, eff.gemm_tflops)
            rows = sorted(table)
            self._gemm_tables[role] = (
                np.log2(np.array(rows, dtype=np.float64)),
                np.array([table[m] for m in rows]) / H800_FP8_TFLOPS * hw.fp8_tflops * 1e12,
            )
        nic = hw.rdma_gb_per_s / 50.0  # the published kernel figures are for 50 GB/s NICs
        low_latency = eff.ll_latency_us_128
        # (dispatch, combine) normal-kernel seconds per row across nodes, low-latency seconds
        # for 128 tokens
        self._normal_s_per_row = tuple(
            deepep.normal_seconds_per_row(
                dep.nodes,
                self.balance.nodes_per_token,
                self.balance.gpus_per_token,
                row_bytes,
                hw.rdma_gb_per_s,
                hw.nvlink_gb_per_s,
                eff.rdma_normal[i],
                eff.nvlink_normal[i],
            )
            if dep.nodes > 1
            else 0.0
            for i, row_bytes in enumerate(token_bytes(model.hidden))
        )
        # DeepEP's low-latency figures move V3's 7,168-dimension rows; another model's rows take
        # their bytes' share of that time (an assumption: the kernels are bandwidth-bound at 128
        # tokens; 1 for V3 and V3.2, 4,096/7,168 for V4-Flash)
        rows = model.hidden / DEEPSEEK_V3.hidden
        self._ll_128 = tuple(
            _interp_ep({k: v[i] for k, v in low_latency.items()}, self.gpus) * 1e-6 / nic * rows
            for i in (0, 1)
        )

    # ---- memory ----------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        """FP8 weights resident on one GPU (attention, shared expert, routed slots, dense MLPs, head);
        V4's routed experts in FP4 (:data:`FP4_BYTES_PER_WEIGHT`), its attention, compressors,
        indexer, router and mHC counted at one byte a weight as V3's are."""
        m = self.model
        if m.v4:
            parts = m.arch.params().parts
            per_layer = sum(
                parts.get(k, 0)
                for k in ("attention", "indexer", "compressor", "router", "norms_and_mhc")
            )
            return float(
                per_layer * m.num_layers / m.arch.num_layers
                + m.num_moe_layers * m.num_shared_experts * m.expert_params
                + m.num_moe_layers * self.balance.slots_per_gpu * m.expert_params
                * FP4_BYTES_PER_WEIGHT
                + 2 * m.hidden * m.vocab
            )  # fmt: skip
        return float(
            m.num_layers * m.attention_params
            + m.num_moe_layers
            * (m.num_shared_experts + self.balance.slots_per_gpu)
            * m.expert_params
            + m.num_dense_layers * m.dense_mlp_params
            + 2 * m.hidden * m.vocab
        )

    @property
    def kv_capacity_tokens_per_gpu(self) -> float:
        """KV-cache tokens one GPU holds after weights (0 when the weights do not fit)."""
        if self._kv_tokens_per_gpu is not None:
            return float(self._kv_tokens_per_gpu)
        free = self.hw.hbm_gb * 1e9 * self.eff.memory_usable - self.weight_bytes_per_gpu
        return max(free, 0.0) / self.model.kv_bytes_per_token

    @property
    def kv_request_overhead_tokens(self) -> float:
        """Tokens of KV capacity a request takes whatever its length (0 for MLA): DeepSeek-V4's
        window and compressor state (``ModelSpec.kv_bytes_per_request``) over its bytes per
        token. A request of ``n`` tokens holds ``n +`` this many."""
        m = self.model
        return m.kv_bytes_per_request / m.kv_bytes_per_token

    def kv_requests_per_gpu(self, mean_kv: float) -> float:
        """Requests of ``mean_kv`` tokens one GPU's KV cache holds: the capacity over ``mean_kv``
        plus :attr:`kv_request_overhead_tokens`."""
        return self.kv_capacity_tokens_per_gpu / (mean_kv + self.kv_request_overhead_tokens)

    def memory_use(self, max_context: int | None = None) -> MemoryUse:
        """What one GPU of this unit holds (:class:`MemoryUse`). Activations of one step: per
        micro-batch of ``n`` tokens (prefill: ``dep.tokens_per_gpu``; decode:
        :data:`DECODE_ACTIVATION_BATCH` requests), the residual and normalised hidden states (BF16),
        MLA's expanded queries, keys and values (BF16), and for the ``r`` expert rows it receives
        (``n`` x experts per token x the expert imbalance) the dispatch buffer (FP8 with scales),
        the experts' gate/up output (BF16) and the combine buffer (BF16); plus FP32 logits of the
        rows through the LM head (prefill: one per 4,096-token prompt; decode: every request).
        ``max_context``: default the model's longest request (``ModelSpec.max_context_tokens``)."""
        m, mb = self.model, self.dep.micro_batches
        max_context = m.max_context_tokens if max_context is None else max_context
        n = float(
            self.dep.tokens_per_gpu if self.dep.phase == "prefill" else DECODE_ACTIVATION_BATCH
        )
        nb = n / mb
        rows = nb * m.experts_per_token * self.balance.imbalance
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.v4:  # mHC's hc_mult residual streams; per head one query and one output of head_dim
            residual = (m.arch.hc_mult + 1) * nb * m.hidden * 2
            heads = nb * m.num_heads * 2 * m.arch.head_dim * 2
        else:
            residual = 2 * nb * m.hidden * 2
            heads = nb * m.num_heads * (2 * qk + m.v_head_dim) * 2
        dispatch_bytes, combine_bytes = token_bytes(m.hidden)
        per_micro_batch = (
            residual
            + heads
            + nb * m.index_n_heads * m.index_head_dim * 2
            + rows * (dispatch_bytes + 2 * m.moe_intermediate * 2 + combine_bytes)
        )
        head_rows = n / 4096.0 if self.dep.phase == "prefill" else n
        return MemoryUse(
            weights=self.weight_bytes_per_gpu,
            activations=mb * per_micro_batch + head_rows * m.vocab * 4,
            kv_one_request=m.kv_bytes(max_context),
            usable=self.hw.hbm_gb * 1e9 * self.eff.memory_usable,
            hbm=self.hw.hbm_gb * 1e9,
            context=max_context,
        )

    def check_fits(self) -> None:
        """Raise InputError naming what does not fit when this unit cannot hold its weights, a
        step's activations and one full-context request per GPU."""
        use = self.memory_use()
        if not use.fits:
            raise InputError(
                f"a {self.dep.nodes}-node {self.dep.phase} unit ({self.dep.redundant_experts} "
                f"redundant experts) on {self.hw.name} does not fit: {use.describe()}"
            )

    # ---- primitives ------------------------------------------------------------------------
    def _gemm(self, flops, weight_bytes, sm_fraction: float = 1.0):
        hw, eff = self.hw, self.eff
        return eff.gemm_time * np.maximum(
            flops / (hw.fp8_tflops * 1e12 * eff.gemm * sm_fraction),
            weight_bytes / (hw.hbm_tb_per_s * 1e12 * eff.memory),
        )

    def _deepgemm(self, role: str, rows, n: int, k: int, sm_fraction: float = 1.0, groups: int = 1):
        """Seconds of ``groups`` FP8 GEMMs ``[rows, k] x [k, n]`` at DeepGEMM's throughput for
        ``role`` at that many rows (log-interpolated, clamped; ``rows`` broadcasts)."""
        log_rows, peak = self._gemm_tables[role]
        rows = np.maximum(np.asarray(rows, dtype=np.float64), 2.0 ** log_rows[0])
        achieved = np.interp(np.log2(rows), log_rows, peak) * sm_fraction
        return self.eff.gemm_time * groups * 2.0 * rows * n * k / achieved

    def _mla_projections(self, tokens, up_tokens, sm_fraction: float = 1.0):
        """The four MLA projection GEMMs for ``tokens`` rows; the kv up-projection runs on
        ``up_tokens`` rows (prefill adds the cached prefix, whose latent KV is up-projected)."""
        m = self.model
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return (
            self._deepgemm(
                "mla_down",
                tokens,
                m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim,
                m.hidden,
                sm_fraction,
            )
            + self._deepgemm("q_up", tokens, m.num_heads * qk, m.q_lora_rank, sm_fraction)
            + self._deepgemm(
                "kv_up",
                up_tokens,
                m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                m.kv_lora_rank,
                sm_fraction,
            )
            + self._deepgemm("attn_out", tokens, m.hidden, m.num_heads * m.v_head_dim, sm_fraction)
        )

    def _experts(self, kind: str, tokens, experts: int, sm_fraction: float = 1.0):
        """Gate+up and down GEMMs of ``experts`` experts sharing ``tokens`` rows each; ``kind``:
        ``""`` (plain, the shared expert), ``"_contiguous"`` or ``"_masked"`` (grouped)."""
        m = self.model
        inter, hidden = m.moe_intermediate, m.hidden
        return self._deepgemm(
            "expert_up" + kind, tokens, 2 * inter, hidden, sm_fraction, experts
        ) + self._deepgemm("expert_down" + kind, tokens, hidden, inter, sm_fraction, experts)

    def _attention(
        self, factor: float, flops, kv_bytes, sm_fraction: float = 1.0, compute: float | None = None
    ):
        """BF16 attention roofline; ``compute``: the kernel's share of the BF16 peak (default
        ``attention_compute``, FlashMLA's dense kernels)."""
        hw, eff = self.hw, self.eff
        share = eff.attention_compute if compute is None else compute
        return factor * np.maximum(
            flops / (hw.bf16_tflops * 1e12 * share * sm_fraction),
            kv_bytes / (hw.hbm_tb_per_s * 1e12 * eff.memory),
        )

    # ---- DeepSeek Sparse Attention -----------------------------------------------------------
    @staticmethod
    def prefill_key_tokens(tokens, context, cached_per_token=0.0):
        """Earlier tokens whose cached keys a prefill micro-batch of ``tokens`` query tokens at
        ``context`` keys each (the mean) reads, each once (broadcasts): a chunk's queries score
        against the same keys, which the kernels take a block at a time for a tile of queries
        (DeepGEMM's MQA logits; vLLM gathers a prefill chunk's index keys once for all its
        queries). At least the tokens themselves with their cache hits
        (``tokens x (1 + cached_per_token)``: prompts whole in the micro-batch) and at least one
        request's context, ``context + tokens / 2`` (a chunk of a longer prompt reads the prefix
        before it: its queries' mean context is the prefix plus half the chunk)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.maximum(tokens * (1.0 + cached_per_token), context + tokens / 2.0)

    def _index_logits_work(self, queries, keys, keys_read, key_bytes):
        """(FLOPs, bytes) of the indexer's logits for ``queries`` queries each scoring ``keys``
        index keys: ``2 x heads x dim`` per query and key; ``keys_read`` index keys of
        ``key_bytes`` read from the cache (prefill: each once, :meth:`prefill_key_tokens`;
        decode: each request's own) and one float32 logit written per query and key."""
        m = self.model
        flops = 2 * m.index_n_heads * m.index_head_dim * queries * keys
        return flops, keys_read * key_bytes + 4 * queries * keys

    def _index_scores(self, queries, keys, keys_read, key_bytes, sm_fraction: float = 1.0):
        """Seconds of the indexer's logits (DeepGEMM's MQA-logits kernels, at the FP8 GEMM rate,
        x ``gemm_time``; :meth:`_index_logits_work`) and of the top-k, reading the logits once
        (HBM-bound); V3.2's and V4's CSA indexers alike."""
        hw, eff = self.hw, self.eff
        flops, bytes_moved = self._index_logits_work(queries, keys, keys_read, key_bytes)
        top_k = 4 * queries * keys / (hw.hbm_tb_per_s * 1e12 * eff.memory)
        return self._gemm(flops, bytes_moved, sm_fraction) + top_k

    def _indexer(self, queries, keys, key_tokens, sm_fraction: float = 1.0):
        """Seconds of the lightning indexer for ``queries`` query tokens each scoring ``keys``
        earlier tokens, whose index keys (``key_tokens`` of them, read once) come from the cache,
        in three kernels one after another as DeepSeek's inference code runs them: the
        projections (FP8 GEMMs: q_lora_rank -> heads x dim, hidden -> dim, hidden -> heads); the
        logits and the top-k (:meth:`_index_scores`). Broadcasts."""
        m = self.model
        projections = self._gemm(2 * queries * m.indexer_params, m.indexer_params, sm_fraction)
        key_bytes = m.index_key_bytes_per_token_layer
        return projections + self._index_scores(queries, keys, key_tokens, key_bytes, sm_fraction)

    def _sparse_mla(self, factor: float, queries, keys, bytes_read, compute: float, sm=1.0):
        """Seconds of MLA in MQA mode (the absorbed form: 576-dimensional keys, 512-dimensional
        values shared by every head) for ``queries`` queries over ``min(keys, index_topk)`` keys
        each; FlashMLA's sparse kernels' ``compute`` share of the BF16 peak."""
        m = self.model
        selected = np.minimum(keys, m.index_topk)
        flops = 2 * m.num_heads * (m.kv_values_per_token_layer + m.kv_lora_rank) * queries
        return self._attention(factor, flops * selected, bytes_read, sm, compute)

    # ---- DeepSeek-V4 -------------------------------------------------------------------------
    def _v4_projections(self, tokens, sm_fraction: float = 1.0):
        """Seconds of the weight GEMMs every V4 layer runs for ``tokens`` rows, at the roofline of
        :meth:`_gemm` (DeepGEMM's table holds V3's shapes, not these): wq_a, wq_b, wkv and the
        grouped output projection wo_a, wo_b in FP8, and the two mHC mixing projections in
        float32 (TF32 runs at a quarter of the FP8 peak: 4x the FP8 FLOPs, 4 bytes a weight)."""
        m, a = self.model, self.model.arch
        d, h, c, r = m.hidden, m.num_heads, a.head_dim, a.o_lora_rank
        fp8 = d * m.q_lora_rank + m.q_lora_rank * h * c + d * c + h * c * r + a.o_groups * r * d
        mhc = 2 * (2 + a.hc_mult) * a.hc_mult * a.hc_mult * d
        return self._gemm(2 * tokens * fp8, fp8, sm_fraction) + self._gemm(
            4 * 2 * tokens * mhc, 4 * mhc, sm_fraction
        )

    def _v4_routed(self, tokens, sm_fraction: float = 1.0):
        """Seconds of the heaviest GPU's routed experts for ``tokens`` tokens per GPU: FP4 weights
        times FP8 activations at the FP8 peak ("the peak FLOPs for FP4 x FP8 operations are
        currently the same as FP8 x FP8", DeepSeek-V4 report, section 1) x ``Efficiency.gemm``,
        against reading every slot's FP4 weights once (:data:`FP4_BYTES_PER_WEIGHT`)."""
        m = self.model
        rows = tokens * m.experts_per_token * self.balance.imbalance
        weights = self._slots * m.expert_params
        return self._gemm(2 * rows * m.expert_params, weights * FP4_BYTES_PER_WEIGHT, sm_fraction)

    def _v4_layer(
        self,
        kind: str,
        tokens,
        context,
        requests=None,
        sm_fraction: float = 1.0,
        key_tokens=None,
    ):
        """(core attention, compressor + indexer) seconds of one V4 layer of ``kind`` for
        ``tokens`` query rows at ``context`` tokens each (broadcasts). Core attention: each head
        scores and sums ``min(context, sliding_window)`` window entries and the compressed ones
        (CSA: ``min(context / 4, index_topk)``, HCA: ``context / 128``), ``4 x head_dim`` BF16
        FLOPs per head and entry, at FlashMLA's sparse kernels' share of the BF16 peak (vLLM runs
        V4's attention on them: ``vllm/models/deepseek_v4/nvidia/flashmla.py``); decoding
        (``requests`` given) reads the window and HCA's entries once per request and a CSA query's
        chosen entries per query; prefill reads the entries of the ``key_tokens`` earlier tokens
        once for the micro-batch (default :meth:`prefill_key_tokens`; the window: the micro-batch's
        own tokens and one window before them; CSA: at most the entries its queries choose, the
        per-query gather of the sparse kernel served from L2, as V3.2's sparse prefill is
        modelled). Compressor: its BF16 projections (wkv, wgate; x2
        the FP8 FLOPs and bytes). CSA's indexer: its projections, the logits of every query
        against every compressed index key at the FP8 GEMM rate (V4 multiplies them in FP4;
        Hopper has no FP4 tensor cores, and no FP4 rate is assumed on other parts either) against
        reading the index keys (in prefill each once for the micro-batch, in decode each
        request's) and writing float32 logits, and the top-k reading them (HBM-bound;
        :meth:`_index_scores`, as V3.2's)."""
        m, a, eff = self.model, self.model.arch, self.eff
        d, h, c = m.hidden, m.num_heads, a.head_dim
        ratio = dict(zip(a.layer_kinds, a.compress_ratios, strict=True)).get(kind, 0)
        context = np.asarray(context, dtype=np.float64)
        window = np.minimum(context, a.sliding_window)
        entries = context / ratio if ratio else 0.0 * context
        chosen = np.minimum(entries, m.index_topk) if kind == CSA else entries
        flops = 4 * h * c * tokens * (window + chosen)
        entry = a.entry_bytes(m.kv_cache_dtype)
        if requests is None:
            factor, compute = eff.attention_time, eff.sparse_prefill_compute
            if key_tokens is None:
                key_tokens = self.prefill_key_tokens(tokens, context)
            # compressed entries (and CSA's index keys) of the earlier tokens, each read once
            index_keys_read = entries_read = key_tokens / ratio if ratio else 0.0 * key_tokens
            if kind == CSA:  # at most what the queries choose
                entries_read = np.minimum(entries_read, tokens * chosen)
            window_read = np.minimum(key_tokens, tokens + a.sliding_window)
            read = entry * (window_read + entries_read)
        else:
            factor, compute = eff.decode_attention_time, eff.sparse_decode_compute
            once = window + (0.0 if kind == CSA else entries)
            read = entry * (requests * once + (tokens * chosen if kind == CSA else 0.0))
            index_keys_read = requests * entries
        core = self._attention(factor, flops, read, sm_fraction, compute)
        extra = 0.0 * core
        if ratio:
            coff = 2 if kind == CSA else 1
            weights = 2 * d * coff * c
            extra = extra + self._gemm(2 * 2 * tokens * weights, 2 * weights, sm_fraction)
        if kind == CSA:
            ih, ic = m.index_n_heads, m.index_head_dim
            fp8 = m.q_lora_rank * ih * ic
            bf16 = d * ih + 2 * d * 2 * ic  # weights_proj, its compressor's wkv and wgate
            extra = extra + self._gemm(2 * tokens * fp8, fp8, sm_fraction)
            extra = extra + self._gemm(2 * 2 * tokens * bf16, 2 * bf16, sm_fraction)
            key_bytes = a.index_key_bytes(m.kv_cache_dtype)
            extra = extra + self._index_scores(
                tokens, entries, index_keys_read, key_bytes, sm_fraction
            )
        return core, extra

    def _v4_prefill_attention(
        self,
        nb: float,
        keys: float,
        sm: float,
        combine: float = 0.0,
        cached_per_token: float = 0.0,
    ):
        """(projections, core attention [layers], compressor + indexer [layers]) seconds of a V4
        prefill micro-batch of ``nb`` tokens at ``keys`` tokens of context each (the window and
        compressed entries of :meth:`_v4_layer`, the cache read once for the micro-batch:
        :meth:`prefill_key_tokens`), the core attention beside the other micro-batch's combine as
        :meth:`_prefill_attention` runs it."""
        proj = float(self._v4_projections(nb, sm))
        core, extra = {}, {}
        kinds = self.model.layer_kinds()
        read = self.prefill_key_tokens(nb, keys, cached_per_token)
        for kind in set(kinds):
            # on every SM, then slowed
            full = float(self._v4_layer(kind, nb, keys, key_tokens=read)[0])
            extra[kind] = float(self._v4_layer(kind, nb, keys, sm_fraction=sm, key_tokens=read)[1])
            core[kind] = float(self._beside_all_to_all(full, sm, combine - proj - extra[kind]))
        return (
            proj,
            np.array([core[k] for k in kinds]),
            np.array([extra[k] for k in kinds]),
        )

    @staticmethod
    def _beside_all_to_all(full_s, sm: float, comm_s):
        """Seconds of an attention kernel that takes ``full_s`` on every SM, started while an
        all-to-all holding the ``1 - sm`` share of the SMs has ``comm_s`` seconds left: it runs
        on the ``sm`` share until the all-to-all ends and on every SM after,
        ``min(full / sm, full + comm * (1 - sm))`` (all of it on the share when it ends first)."""
        if sm >= 1.0:
            return full_s
        return np.minimum(full_s / sm, full_s + np.maximum(comm_s, 0.0) * (1.0 - sm))

    def _prefill_attention(
        self, nb: float, keys: float, cached_per_token: float, sm: float, combine: float = 0.0
    ):
        """(MLA projections, core attention, indexer) seconds of a prefill micro-batch of ``nb``
        tokens attending to ``keys`` keys each, beside the other micro-batch's combine
        (``combine`` seconds, which starts with this segment). Dense: MHA mode over every key
        (the cached prefix' latent up-projected; :attr:`Efficiency.mha_prefill_compute`). Sparse
        (V3.2): the indexer, and the cheaper of DeepSeek's two kernels — MLA's MQA mode over the
        ``index_topk`` selected keys (FlashMLA's sparse prefill; no up-projection of the prefix)
        or, for short contexts, MHA mode over all of them with the selection as a mask (the
        report's "masked MHA mode"). Projections and indexer are GEMMs on the ``sm`` share; the
        core attention runs after them, on that share only while the combine lasts."""
        m, eff = self.model, self.eff
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        up_tokens = nb * (1 + cached_per_token)
        kv_bytes = up_tokens * m.latent_bytes_per_token_layer
        proj = self._mla_projections(nb, up_tokens, sm)
        # the roofline's two sides: compute on every SM, and reading the KV (which the SM share
        # does not slow)
        mha_flops = 2 * m.num_heads * (qk + m.v_head_dim) * nb * keys
        mha = self._attention(eff.attention_time, mha_flops, 0.0, compute=eff.mha_prefill_compute)
        read = self._attention(eff.attention_time, 0.0, kv_bytes)
        if not m.sparse:
            return proj, float(max(self._beside_all_to_all(mha, sm, combine - proj), read)), 0.0
        indexer = float(
            self._indexer(nb, keys, self.prefill_key_tokens(nb, keys, cached_per_token), sm)
        )
        core = float(max(self._beside_all_to_all(mha, sm, combine - proj - indexer), read))
        sparse_proj = self._mla_projections(nb, nb, sm)
        sparse = self._sparse_mla(eff.attention_time, nb, keys, 0.0, eff.sparse_prefill_compute)
        sparse = float(
            max(self._beside_all_to_all(sparse, sm, combine - sparse_proj - indexer), read)
        )
        if sparse_proj + sparse < proj + core:
            return sparse_proj, sparse, indexer
        return proj, core, indexer

    def prefill_attention_weight(self, keys) -> np.ndarray:
        """Relative prefill cost per token of the work that grows with the keys a token attends
        to (``keys``, broadcasts), for spreading a step's attention over prompts of different
        lengths: ``keys`` itself for dense attention (FLOPs proportional to it); for sparse
        attention the compute time per token and layer of the indexer's logits plus the cheaper
        core-attention mode (seconds); for DeepSeek-V4 a token's core attention and indexer
        seconds over its layers per token of a micro-batch of the unit's size (:meth:`_v4_layer`;
        what it reads once for the micro-batch, the weights and the cache, shared by its
        tokens)."""
        keys = np.asarray(keys, dtype=np.float64)
        m, hw, eff = self.model, self.hw, self.eff
        if not m.sparse:
            return keys
        if m.v4:
            kinds = m.layer_kinds()
            nb = self.dep.tokens_per_gpu / self.dep.micro_batches
            # in the schedule's order (a set's order varies with the hash seed, and so would the
            # sum's last bit, which the planner's queue simulation can amplify)
            order = dict.fromkeys(kinds)
            per_kind = {k: sum(self._v4_layer(k, nb, keys)) / nb for k in order}
            return sum(kinds.count(k) * per_kind[k] for k in order)
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        bf16 = hw.bf16_tflops * 1e12
        mha = 2 * m.num_heads * (qk + m.v_head_dim) * keys / (bf16 * eff.mha_prefill_compute)
        mqa = (
            2
            * m.num_heads
            * (m.kv_values_per_token_layer + m.kv_lora_rank)
            * np.minimum(keys, m.index_topk)
            / (bf16 * eff.sparse_prefill_compute)
        )
        logits = 2 * m.index_n_heads * m.index_head_dim * keys / (hw.fp8_tflops * 1e12 * eff.gemm)
        top_k = 4 * keys / (hw.hbm_tb_per_s * 1e12 * eff.memory)
        return eff.attention_time * np.minimum(mha, mqa) + eff.gemm_time * logits + top_k

    def _a2a_normal(self, tokens):
        """Dispatch and combine seconds for ``tokens`` per GPU with DeepEP normal kernels."""
        m, dep = self.model, self.dep
        if dep.nodes == 1:
            bw = self.hw.nvlink_gb_per_s * 1e9 * self.eff.nvlink / self.eff.comm_time
            dests = min(m.experts_per_token, self.gpus) * (1 - 1 / self.gpus)
            return (
                tokens * DISPATCH_BYTES_PER_TOKEN * dests / bw + self.eff.comm_launch_s,
                tokens * COMBINE_BYTES_PER_TOKEN * dests / bw + self.eff.comm_launch_s,
            )
        rows = tokens * self.balance.imbalance * self.eff.comm_time
        return tuple(rows * self._normal_s_per_row[i] + self.eff.comm_launch_s for i in (0, 1))

    def _a2a_low_latency(self, tokens):
        """Dispatch and combine seconds for ``tokens`` per GPU with DeepEP low-latency kernels."""
        scale = tokens * self.balance.imbalance / 128.0
        fixed, f, wait = self.eff.ll_fixed_share, self.eff.comm_time, self.eff.ll_wait_s
        return tuple(
            f * self._ll_128[i] * (fixed[i] + (1.0 - fixed[i]) * scale) + wait for i in (0, 1)
        )

    def all_to_all_s(self, tokens_per_gpu: float) -> tuple[float, float]:
        """(dispatch, combine) seconds of one all-to-all call of ``tokens_per_gpu`` tokens per GPU:
        DeepEP's normal kernels in prefill, its low-latency kernels in decode."""
        if self.gpus == 1:
            return 0.0, 0.0
        kernel = self._a2a_normal if self.dep.phase == "prefill" else self._a2a_low_latency
        dispatch, combine = kernel(float(tokens_per_gpu))
        return float(dispatch), float(combine)

    def routed_experts_s(self, tokens_per_gpu: float) -> float:
        """Seconds of the heaviest GPU's routed-expert GEMMs for ``tokens_per_gpu`` tokens per GPU
        on all SMs (contiguous grouped kernel in prefill, masked in decode)."""
        kind = "_contiguous" if self.dep.phase == "prefill" else "_masked"
        return float(self._experts(kind, self._rows_per_expert(float(tokens_per_gpu)), self._slots))

    @cached_property
    def _decode_gemm_curves(self):
        """Decode's GEMM seconds per micro-batch on a 1/16-octave grid of tokens per GPU (2^-4 to
        2^20), interpolated per call (the step model runs for every unit and tick): MLA projections
        (absorbed: the kv up-projection folds into q and the output, same FLOPs and weights), the
        shared expert, the routed experts (masked grouped kernel). Each curve is made
        non-decreasing: DeepGEMM's throughput, log-interpolated between its published rows, rises
        faster than the rows between 64 and 128 (287 -> 533 TFLOPS), and a kernel is never slower
        on fewer rows than it is on more (it could run them padded)."""
        grid = np.arange(-4.0, 20.0 + 1 / 32, 1 / 16)
        tokens = 2.0**grid
        if self.model.v4:
            curves = (
                self._v4_projections(tokens),
                self._experts("", tokens, self.model.num_shared_experts),
                self._v4_routed(tokens),
            )
        else:
            curves = (
                self._mla_projections(tokens, tokens),
                self._experts("", tokens, self.model.num_shared_experts),
                self._experts("_masked", self._rows_per_expert(tokens), self._slots),
            )
        return (grid, *(np.maximum.accumulate(c) for c in curves))

    @property
    def _slots(self) -> int:
        return self.balance.slots_per_gpu

    def _rows_per_expert(self, tokens):
        """Rows each routed-expert slot of the heaviest GPU gets from ``tokens`` tokens per GPU."""
        return tokens * self.model.experts_per_token * self.balance.imbalance / self._slots

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_breakdown(
        self,
        tokens_per_gpu: float | None = None,
        cached_per_token: float = 0.0,
        attn_keys_per_token: float | None = None,
        prompt_len: float = 4096.0,
    ) -> LayerBreakdown:
        """One prefill step where each GPU computes ``tokens_per_gpu`` uncached prompt tokens.

        ``attn_keys_per_token``: mean keys each new token attends to (cached prefix + causal half of
        the new part); default half of ``tokens_per_gpu`` capped at a 4K prompt.
        ``cached_per_token``: cache-hit tokens per computed token (their latent KV is up-projected).
        ``prompt_len``: computed tokens per prompt; the LM head and sampling run once per prompt.
        """
        m, eff = self.model, self.eff
        n = float(self.dep.tokens_per_gpu if tokens_per_gpu is None else tokens_per_gpu)
        if n <= 0:
            raise InputError(f"tokens_per_gpu={n} must be > 0")
        keys = min(n, 4096.0) / 2 if attn_keys_per_token is None else attn_keys_per_token
        mb = self.dep.micro_batches
        nb = n / mb
        sm = eff.prefill_compute_sms if mb == 2 and self.gpus > 1 else 1.0
        shared = self._experts("", nb, m.num_shared_experts, sm)
        if m.v4:
            routed = self._v4_routed(nb, sm)
        else:
            routed = self._experts("_contiguous", self._rows_per_expert(nb), self._slots, sm)
        gate = self._gemm(
            2 * nb * m.hidden * m.num_routed_experts, m.hidden * m.num_routed_experts, sm
        )
        dense = self._gemm(2 * nb * m.dense_mlp_params, m.dense_mlp_params, sm)
        dispatch, combine = self._a2a_normal(nb) if self.gpus > 1 else (0.0, 0.0)
        routed, dispatch, combine, sources = self._measured(nb, sm, routed, dispatch, combine)
        if m.v4:
            attn_proj, core, indexer = self._v4_prefill_attention(
                nb, keys, sm, float(combine), cached_per_token
            )
        else:
            attn_proj, core, indexer = self._prefill_attention(
                nb, keys, cached_per_token, sm, float(combine)
            )
        parts = (attn_proj, core, shared, routed, gate, dense, dispatch, combine)
        return self._assemble(
            "prefill",
            n,
            mb,
            *parts,
            head_tokens=n / max(prompt_len, 1.0),
            sources=sources,
            indexer=indexer if m.sparse else None,
        )

    def prefill_seconds_per_token(
        self, cached_fraction: float = 0.0, mean_prompt: float = 4096.0
    ) -> float:
        """Unit-seconds per uncached token at the nominal batch (``dep.tokens_per_gpu``)."""
        computed = max(1.0 - cached_fraction, 1e-6)
        keys = mean_prompt * cached_fraction + mean_prompt * computed / 2
        b = self.prefill_breakdown(
            cached_per_token=cached_fraction / computed,
            attn_keys_per_token=keys,
            prompt_len=max(mean_prompt * computed, 1.0),
        )
        return b.step_s / (b.tokens_per_gpu * self.gpus)

    # ---- decode ----------------------------------------------------------------------------
    def decode_breakdown(self, batch_per_gpu: float, mean_kv: float) -> LayerBreakdown:
        """One decode step with ``batch_per_gpu`` requests per GPU of mean KV length ``mean_kv``."""
        if batch_per_gpu <= 0 or mean_kv < 0:
            raise InputError(
                f"batch_per_gpu={batch_per_gpu} must be > 0 and mean_kv={mean_kv} >= 0"
            )
        q = self.queries
        parts = self._decode_parts(np.asarray(batch_per_gpu, float), np.asarray(mean_kv, float), q)
        nb = batch_per_gpu * q / self.dep.micro_batches
        routed, dispatch, combine, sources = self._measured(nb, 1.0, *parts[3:4], *parts[6:8])
        core, indexer = parts[1], parts[8]
        if self.model.v4:  # per kind -> per layer
            kinds = self.model.layer_kinds()
            core = np.array([float(core[k]) for k in kinds])
            indexer = np.array([float(indexer[k]) for k in kinds])
        parts = (parts[0], core, parts[2], routed, *parts[4:6], dispatch, combine)
        return self._assemble(
            "decode",
            batch_per_gpu,
            self.dep.micro_batches,
            *parts,
            head_tokens=batch_per_gpu * q,
            sources=sources,
            indexer=indexer if self.model.sparse else None,
        )

    def _measured(self, tokens: float, sm_fraction: float, routed, dispatch, combine):
        """The routed experts, dispatch and combine of a micro-batch of ``tokens`` per GPU from
        the measured kernel tables where they cover this unit (``self.kernels``), and each part's
        source; unchanged (and no sources) without tables."""
        if self.kernels is None:
            return routed, dispatch, combine, {}
        times = self.kernels.moe_parts(
            self.dep.phase,
            self.dep.nodes,
            self.gpus,
            self._moe_shape,
            heaviest_tokens=tokens * self.balance.imbalance,
            sm_fraction=sm_fraction,
            first_principles={"routed": routed, "dispatch": dispatch, "combine": combine},
        )
        sources = {name: t.label for name, t in times.items()}
        return times["routed"].seconds, times["dispatch"].seconds, times["combine"].seconds, sources

    def _measured_many(self, tokens, routed, dispatch, combine):
        """:meth:`_measured` over arrays of micro-batch ``tokens`` per GPU (decode steps of many
        units at once), seconds only."""
        curve, a2a = self._kernel_curves
        heaviest = np.asarray(tokens, dtype=np.float64) * self.balance.imbalance
        if curve is not None:
            routed = curve.seconds_at(heaviest, routed)
        if a2a is not None:
            dispatch, combine = (
                c.seconds_at(heaviest, t) for c, t in zip(a2a, (dispatch, combine), strict=True)
            )
        return routed, dispatch, combine

    @property
    def _moe_shape(self) -> dict[str, int]:
        """The MoE dimensions the measured tables are keyed by."""
        m = self.model
        return {
            "hidden": m.hidden,
            "topk": m.experts_per_token,
            "experts": m.num_routed_experts,
            "inter": m.moe_intermediate,
        }

    @cached_property
    def _kernel_curves(self):
        return self.kernels.moe_curves(self.dep.phase, self.dep.nodes, self.gpus, self._moe_shape)

    def kernel_coverage(self) -> dict[str, str] | None:
        """Per MoE part, which measured kernel table applies and over which tokens per GPU
        (outside them, and for every other part, the first-principles time); None without
        tables."""
        if self.kernels is None:
            return None
        curve, a2a = self._kernel_curves
        none = f"first-principles (no measured table for this {self.dep.nodes}-node unit)"
        out = {"routed": none if curve is None else curve.covers()}
        for i, part in enumerate(("dispatch", "combine")):
            out[part] = none if a2a is None else a2a[i].covers()
        return out

    def _decode_parts(self, b, kv, queries: int = 1):
        """Per micro-batch parts of a decode step of ``b`` requests per GPU, each with ``queries``
        new tokens (2 when a multi-token-prediction draft is verified) over its ``kv`` cached
        keys: the GEMMs, the all-to-all and the attention FLOPs grow with the tokens, the KV read
        does not (dense attention; sparse attention reads each query's ``index_topk`` selected
        latents, and the request's index keys once). The eight :data:`PARTS`, then the indexer
        (0 when dense)."""
        m = self.model
        mb = self.dep.micro_batches
        nb = b / mb
        tokens = nb * queries
        log_tokens = np.log2(np.maximum(tokens, 1e-9))
        grid, attn_curve, shared_curve, routed_curve = self._decode_gemm_curves
        attn_proj = np.interp(log_tokens, grid, attn_curve)
        kv_vals = m.kv_values_per_token_layer
        if m.v4:  # {kind: seconds}
            core, indexer = {}, {}
            for kind in set(m.layer_kinds()):
                core[kind], indexer[kind] = self._v4_layer(kind, tokens, kv, requests=nb)
        elif m.sparse:
            core = self._sparse_mla(
                self.eff.decode_attention_time,
                tokens,
                kv,
                tokens * np.minimum(kv, m.index_topk) * m.latent_bytes_per_token_layer,
                self.eff.sparse_decode_compute,
            )
            indexer = self._indexer(tokens, kv, nb * kv)
        else:
            core = self._attention(
                self.eff.decode_attention_time,
                2 * m.num_heads * (kv_vals + m.kv_lora_rank) * tokens * kv,
                nb * kv * m.latent_bytes_per_token_layer,
            )
            indexer = 0.0 * tokens
        shared = np.interp(log_tokens, grid, shared_curve)
        routed = np.interp(log_tokens, grid, routed_curve)
        gate = self._gemm(
            2 * tokens * m.hidden * m.num_routed_experts, m.hidden * m.num_routed_experts
        )
        dense = self._gemm(2 * tokens * m.dense_mlp_params, m.dense_mlp_params)
        dispatch, combine = (
            self._a2a_low_latency(tokens) if self.gpus > 1 else (0.0 * tokens, 0.0 * tokens)
        )
        return attn_proj, core, shared, routed, gate, dense, dispatch, combine, indexer

    def decode_step_s(
        self, batch_per_gpu, mean_kv, request_imbalance=1.0, kv_imbalance=1.0, queries=None
    ):
        """Seconds of one decode step, vectorised: ``batch_per_gpu`` and ``mean_kv`` broadcast
        (arrays ``[units]``); ``queries`` new tokens per request per step (default the unit's: 1;
        2 verifying a multi-token-prediction draft).

        The step is paced by the slowest DP rank: it holds ``request_imbalance`` x the mean request
        count and ``kv_imbalance`` x the mean KV tokens (from the decode load balancer).
        """
        queries = self.queries if queries is None else queries
        b = np.maximum(np.asarray(batch_per_gpu, dtype=np.float64), 1e-9) * request_imbalance
        kv = np.asarray(mean_kv, dtype=np.float64) * (kv_imbalance / request_imbalance)
        m = self.model
        mb = self.dep.micro_batches
        attn_proj, core, shared, routed, gate, dense, dispatch, combine, indexer = (
            self._decode_parts(b, kv, queries)
        )
        if self.kernels is not None:
            routed, dispatch, combine = self._measured_many(
                b * queries / mb, routed, dispatch, combine
            )
        head = self._gemm(2 * b * queries * m.hidden * m.vocab, m.hidden * m.vocab)
        if m.v4:  # every layer MoE; attention by layer kind
            layers = 0.0
            for kind in dict.fromkeys(m.layer_kinds()):  # a fixed order: the same last bit
                attention = attn_proj + core[kind] + indexer[kind] + gate
                count = m.layer_kinds().count(kind)
                layers = layers + count * _overlapped(
                    mb, attention, shared + routed, dispatch, combine
                )
            return layers + head + self.eff.step_overhead_s
        if m.sparse:  # dense models add nothing: their numbers stay bit for bit
            core = core + indexer
        moe_layer = _overlapped(mb, attn_proj + core + gate, shared + routed, dispatch, combine)
        dense_layer = mb * (attn_proj + core + dense)
        layers = m.num_moe_layers * moe_layer + m.num_dense_layers * dense_layer
        return layers + head + self.eff.step_overhead_s

    # ---- shared assembly ---------------------------------------------------------------------
    def _assemble(
        self,
        phase,
        n,
        mb,
        attn_proj,
        core,
        shared,
        routed,
        gate,
        dense,
        dispatch,
        combine,
        *,
        head_tokens,
        sources: dict[str, str] | None = None,
        indexer=None,
    ) -> LayerBreakdown:
        """The step of per-micro-batch part seconds; ``indexer``: the sparse-attention indexer's
        (None for dense attention: no such part)."""
        m = self.model
        layers = m.num_layers
        is_moe = np.arange(layers) >= m.num_dense_layers
        f = float

        def per_layer(x):  # a scalar, or [layers] (V4: by layer kind)
            return np.broadcast_to(np.asarray(x, dtype=np.float64), (layers,))

        core = per_layer(core)
        parts = {
            "attn_proj": np.full(layers, mb * f(attn_proj)),
            "core_attn": mb * core,
            "shared": np.where(is_moe, mb * f(shared), 0.0),
            "routed": np.where(is_moe, mb * f(routed), 0.0),
            "gate": np.where(is_moe, mb * f(gate), 0.0),
            "dense_mlp": np.where(is_moe, 0.0, mb * f(dense)),
            "dispatch": np.where(is_moe, mb * f(dispatch), 0.0),
            "combine": np.where(is_moe, mb * f(combine), 0.0),
        }
        attention = f(attn_proj) + core + f(gate)
        if indexer is not None:
            indexer = per_layer(indexer)
            parts = {"attn_proj": parts["attn_proj"], INDEXER: mb * indexer} | {
                k: v for k, v in parts.items() if k != "attn_proj"
            }
            attention = attention + indexer
        compute = sum(v for k, v in parts.items() if k not in ("dispatch", "combine"))
        comm = parts["dispatch"] + parts["combine"]
        moe_layer = _overlapped(mb, attention, f(shared) + f(routed), f(dispatch), f(combine))
        layer = np.where(is_moe, moe_layer, compute)
        head = float(self._gemm(2 * head_tokens * m.hidden * m.vocab, m.hidden * m.vocab))
        overhead = self.eff.step_overhead_s
        if phase == "prefill":
            overhead += self.eff.prompt_overhead_s * head_tokens
        step = float(layer.sum()) + head + overhead
        return LayerBreakdown(
            phase, parts, compute, comm, layer, head, overhead, step, float(n), sources or {}
        )
