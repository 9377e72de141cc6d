"""Cost per million tokens by token position: what the token at position ``p`` of a sequence costs
to prefill and to decode, the curve DeepSeek published for V3.1-Terminus against V3.2-Exp on H800
(V3.2-Exp report, Figure 3; digitised in ``data/measurements/deepseek-v32-cost-by-position.json``).

Prefill: a step of ``tokens_per_gpu`` tokens on every GPU of a prefill unit, each attending to ``p``
keys: a chunk of a long prompt whose tokens sit at ``p`` on average, so ``p - tokens_per_gpu / 2``
tokens of its prompt came before it (a cached prefix, whose latent MHA mode up-projects again for
the chunk, and whose index keys V3.2's indexer reads). The figure plots "how token costs ... vary
with the token position": the cost of the token at ``p``, not the mean over a prompt of length
``p``. Decode: a step of ``decode_batch_per_gpu`` requests per GPU of a decode unit, each with
``p`` cached tokens, verifying one multi-token-prediction draft per request as DeepSeek's service
decodes (:data:`DEEPSEEK_DECODE_MTP_ACCEPTANCE`). Either way the step's GPU-seconds are shared by
the tokens it makes, at the hardware's price: ``step_s / tokens per GPU x gpu_hour_usd / 3600 x
1e6``. A batch of 128 requests all at 128K is not one a GPU holds (it is the cost the token at that
position adds to a step of the unit's usual batch, as the figure attributes it): every part of the
step that does not depend on the position is shared as in any batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, Efficiency, PerfModel
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    Deployment,
    HardwareSpec,
    ModelSpec,
    deepseek_decode_unit,
    deepseek_prefill_unit,
    hardware,
)

#: Decode requests per GPU the decode cost is shared over: DeepSeek's published decode profile
#: (deepseek-ai/profile-data: "a batch size of 128 requests per GPU"), also the batch at which
#: FlashMLA times its sparse decoding kernel (below).
DECODE_BATCH_PER_GPU = 128.0
#: Share of multi-token-prediction drafts accepted when decoding as DeepSeek's service does: each
#: step verifies one draft per request beside the next token, two query tokens per request.
#: DeepSeek's FlashMLA (deepseek-ai/FlashMLA) lists V3.2's production decoding case as 128 query
#: heads and ``s_q`` = 2 query tokens per request (tests/test_flash_mla_sparse_decoding.py,
#: "Production cases", "V3.2", commit 082094b, 2026-01-16) and times its sparse decoding kernel's
#: 410 TFLOPS at batch 128, 128 heads, ``s_q`` = 2, top-k 2,048
#: (docs/20250929-hopper-fp8-sparse-deep-dive.md); its README: "``s_q`` is the number of q tokens
#: per q sequence. If MTP (speculative decoding) is disabled, it should be 1". DeepGEMM's paged
#: MQA-logits kernel (deepseek-ai/DeepGEMM; the indexer's decode logits) takes ``next_n`` = 1 or 2
#: query tokens per request against one read of its index keys (tests/test_attention.py, 80ceeb2,
#: 2025-09-29). The share accepted is the DeepSeek-V3 report's (section 5.4.3: 85-90% of second
#: tokens). It sets the USD level only: both models make ``1 + acceptance`` tokens a step, so the
#: V3.2 / V3.1 ratio does not depend on it.
DEEPSEEK_DECODE_MTP_ACCEPTANCE = 0.85
#: The positions the comparison with the published curve is made at (K tokens, 1K = 1,024).
COMPARED_AT_K = (32, 64, 128)
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PositionCost:
    """USD per million tokens at each of ``positions`` (tokens), ``[positions]`` each."""

    model: str
    kv_cache_dtype: str
    positions: np.ndarray
    prefill_usd_per_mtok: np.ndarray
    decode_usd_per_mtok: np.ndarray

    def phase(self, name: str) -> np.ndarray:
        return self.prefill_usd_per_mtok if name == "prefill" else self.decode_usd_per_mtok

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "positions": self.positions.tolist(),
            "prefill_usd_per_mtok": self.prefill_usd_per_mtok.tolist(),
            "decode_usd_per_mtok": self.decode_usd_per_mtok.tolist(),
        }


def position_cost(
    model: ModelSpec,
    positions,
    *,
    hw: HardwareSpec | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    prefill_dep: Deployment | None = None,
    decode_dep: Deployment | None = None,
    decode_batch_per_gpu: float = DECODE_BATCH_PER_GPU,
) -> PositionCost:
    """Cost per million tokens of ``model`` at each of ``positions`` (tokens, ``[positions]``) on
    ``hw`` (default H800 at 2 USD per GPU-hour), prefill on ``prefill_dep`` (default DeepSeek's
    4-node unit, 16K tokens per GPU per step) and decode on ``decode_dep`` (default DeepSeek's
    18-node unit decoding as its service does, :func:`deepseek_service_decode_unit`) at
    ``decode_batch_per_gpu`` requests per GPU; with multi-token prediction
    (``decode_dep.mtp_acceptance``) a decode step makes ``1 + acceptance`` tokens per request."""
    hw = hw or hardware("h800")
    positions = np.asarray(positions, dtype=np.float64).reshape(-1)
    if positions.size == 0 or not (np.isfinite(positions).all() and (positions >= 0).all()):
        raise InputError(f"positions={positions.tolist()} must be finite numbers >= 0")
    if not (np.isfinite(decode_batch_per_gpu) and decode_batch_per_gpu > 0):
        raise InputError(f"decode_batch_per_gpu={decode_batch_per_gpu} must be a number > 0")
    prefill = PerfModel(prefill_dep or deepseek_prefill_unit(), hw, model, eff)
    decode = PerfModel(decode_dep or deepseek_service_decode_unit(), hw, model, eff)
    usd_per_gpu_s_mtok = hw.gpu_hour_usd / 3600.0 * 1e6
    n = float(prefill.dep.tokens_per_gpu)
    prefill_usd = np.array(
        [
            prefill.prefill_breakdown(
                cached_per_token=max(p - n / 2, 0.0) / n,
                attn_keys_per_token=p,
                prompt_len=max(p, n),
            ).step_s
            / n
            for p in positions
        ]
    )
    step = np.asarray(decode.decode_step_s(decode_batch_per_gpu, positions), dtype=np.float64)
    decode_usd = step / (decode_batch_per_gpu * decode.dep.tokens_per_step)
    return PositionCost(
        model.name,
        model.kv_cache_dtype,
        positions,
        prefill_usd * usd_per_gpu_s_mtok,
        decode_usd * usd_per_gpu_s_mtok,
    )


def published_cost_by_position() -> dict:
    """DeepSeek's published curve as shipped (``source``: where from and how digitised; per
    phase, per model ``[[position K, USD per million tokens], ...]``)."""
    path = resources.files("moeinfra.serving").joinpath(
        "data/measurements/deepseek-v32-cost-by-position.json"
    )
    return json.loads(path.read_text())


def published_at(phase: str, series: str, positions_k) -> np.ndarray:
    """The published USD per million tokens of ``series`` (``v3.1-terminus`` or ``v3.2-exp``) in
    ``phase`` at ``positions_k`` (K tokens; linear between digitised points)."""
    points = np.array(published_cost_by_position()[phase][series], dtype=np.float64)
    return np.interp(np.asarray(positions_k, dtype=np.float64), points[:, 0], points[:, 1])


def deepseek_service_decode_unit(
    mtp_acceptance: float = DEEPSEEK_DECODE_MTP_ACCEPTANCE,
) -> Deployment:
    """DeepSeek's 18-node decode unit as its service decodes: one multi-token-prediction draft
    verified per request each step, ``mtp_acceptance`` of them accepted (0: no MTP)."""
    return deepseek_decode_unit().with_(mtp_acceptance=mtp_acceptance)


def deepseek_service_models(
    v32_kv_cache_dtype: str = "fp8",
) -> tuple[ModelSpec, ModelSpec]:
    """(V3.1-Terminus, V3.2) as DeepSeek's kernels serve them: V3.1-Terminus has V3's shape and a
    BF16 cache (FlashMLA's dense decoding kernel reads BF16), V3.2 an FP8 one (its sparse decoding
    kernel reads FlashMLA's FP8 layout, and DeepSeek's inference code keeps the index keys in FP8);
    ``v32_kv_cache_dtype`` changes the latter."""
    v31 = DEEPSEEK_V3.with_kv_cache_dtype("bf16")
    return v31, DEEPSEEK_V32.with_kv_cache_dtype(v32_kv_cache_dtype)


def compare_with_published(
    positions_k=COMPARED_AT_K,
    *,
    v32_kv_cache_dtype: str = "fp8",
    mtp_acceptance: float = DEEPSEEK_DECODE_MTP_ACCEPTANCE,
    hw: HardwareSpec | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    decode_batch_per_gpu: float = DECODE_BATCH_PER_GPU,
) -> dict:
    """The model's V3.2 / V3.1-Terminus cost ratio by position against the published one, per
    phase: ``{phase: {"positions_k", "v31_usd", "v32_usd", "ratio", "published_v31_usd",
    "published_v32_usd", "published_ratio", "model_over_published"}}`` (lists over
    ``positions_k``), on DeepSeek's units (:func:`position_cost`), MTP at ``mtp_acceptance``
    (default DeepSeek's service, :data:`DEEPSEEK_DECODE_MTP_ACCEPTANCE`; 0: no MTP)."""
    positions_k = np.asarray(positions_k, dtype=np.float64)
    v31, v32 = deepseek_service_models(v32_kv_cache_dtype)
    decode_dep = deepseek_service_decode_unit(mtp_acceptance)
    costs = [
        position_cost(
            m,
            positions_k * 1024,
            hw=hw,
            eff=eff,
            decode_dep=decode_dep,
            decode_batch_per_gpu=decode_batch_per_gpu,
        )
        for m in (v31, v32)
    ]
    out = {}
    for phase in PHASES:
        a, b = costs[0].phase(phase), costs[1].phase(phase)
        pa = published_at(phase, "v3.1-terminus", positions_k)
        pb = published_at(phase, "v3.2-exp", positions_k)
        out[phase] = {
            "positions_k": positions_k.tolist(),
            "v31_usd": a.tolist(),
            "v32_usd": b.tolist(),
            "ratio": (b / a).tolist(),
            "published_v31_usd": pa.tolist(),
            "published_v32_usd": pb.tolist(),
            "published_ratio": (pb / pa).tolist(),
            "model_over_published": ((b / a) / (pb / pa)).tolist(),
        }
    return out
