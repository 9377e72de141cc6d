"""The achieved fractions of peak the step model runs at (:class:`Efficiency`), and the published
kernel figures they come from: DeepGEMM's FP8 GEMM throughput and DeepSeek's MHA-mode attention
kernel as its H800 training profile times it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving import deepep

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
