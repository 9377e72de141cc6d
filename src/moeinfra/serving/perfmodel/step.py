"""The step model every architecture shares: per-layer, per-step time of a prefill or decode unit
(formulas in docs/serving-model.md), the architecture's own terms from its
:class:`~moeinfra.serving.perfmodel.registry.CostTerms`.

A layer runs two micro-batches; it costs ``max(compute path, communication path)`` (dual micro-batch
overlap in prefill, the 5-stage pipeline in decode), plus the non-overlapped head. The routed-expert
GEMMs and the dispatch/combine receive volume are multiplied by the EPLB expert imbalance of the unit.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.kernels import KernelTables
from moeinfra.serving.perfmodel.all_to_all import AllToAll, kernel_rates
from moeinfra.serving.perfmodel.breakdown import INDEXER, DecodeParts, LayerBreakdown, overlapped
from moeinfra.serving.perfmodel.efficiency import DEFAULT_EFFICIENCY, Efficiency
from moeinfra.serving.perfmodel.indexer import IndexerKernels
from moeinfra.serving.perfmodel.measured_kernels import MeasuredKernels
from moeinfra.serving.perfmodel.memory import MemoryFit
from moeinfra.serving.perfmodel.registry import cost_terms
from moeinfra.serving.perfmodel.roofline import Roofline, gemm_tables
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    Deployment,
    ExpertBalance,
    HardwareSpec,
    ModelSpec,
    expert_balance,
)


class PerfModel(Roofline, IndexerKernels, AllToAll, MeasuredKernels, MemoryFit):
    """Time model of one deployment unit (``dep``) of ``model`` on ``hw``.

    The expert imbalance (EPLB plan on a synthetic skewed load) is computed once here.
    ``kv_tokens_per_gpu`` fixes the KV-cache capacity (an engine's configured blocks) instead of
    deriving it from HBM left after the weights. ``kernels``: measured kernel tables whose
    all-to-all and routed-expert times replace the first-principles ones in
    :meth:`prefill_breakdown` and :meth:`decode_breakdown` where they cover the unit
    (:meth:`decode_step_s`, the simulator's, refuses them). ``costs``: the terms of the
    architecture (by ``model.model_type``).
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
        self.costs = cost_terms(model.model_type)
        self.kernels = kernels
        self._kv_tokens_per_gpu = kv_tokens_per_gpu
        self._gemm_tables = gemm_tables(eff, hw)
        self._normal_s_per_row, self._ll_128 = kernel_rates(
            dep, hw, eff, self.balance, model.hidden
        )

    @property
    def _slots(self) -> int:
        return self.balance.slots_per_gpu

    def _rows_per_expert(self, tokens):
        """Rows each routed-expert slot of the heaviest GPU gets from ``tokens`` tokens per GPU."""
        return tokens * self.model.experts_per_token * self.balance.imbalance / self._slots

    def routed_experts_s(self, tokens_per_gpu: float) -> float:
        """Seconds of the heaviest GPU's routed-expert GEMMs for ``tokens_per_gpu`` tokens per GPU
        on all SMs (contiguous grouped kernel in prefill, masked in decode)."""
        kind = "_contiguous" if self.dep.phase == "prefill" else "_masked"
        return float(self._experts(kind, self._rows_per_expert(float(tokens_per_gpu)), self._slots))

    def prefill_attention_weight(self, keys) -> np.ndarray:
        """Relative prefill cost per token of the work that grows with the keys a token attends
        to (``keys``, broadcasts), for spreading a step's attention over prompts of different
        lengths: ``keys`` itself for dense attention (FLOPs proportional to it); for sparse
        attention the compute time per token and layer of the indexer's logits plus the cheaper
        core-attention mode (seconds); for DeepSeek-V4 a token's core attention and indexer
        seconds over its layers (:attr:`CostTerms.attention_weight`)."""
        return self.costs.attention_weight(self, np.asarray(keys, dtype=np.float64))

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
        routed = self.costs.routed(self, "prefill", nb, sm)
        gate = self._gemm(
            2 * nb * m.hidden * m.num_routed_experts, m.hidden * m.num_routed_experts, sm
        )
        dense = self._gemm(2 * nb * m.dense_mlp_params, m.dense_mlp_params, sm)
        dispatch, combine = self._a2a_normal(nb) if self.gpus > 1 else (0.0, 0.0)
        routed, dispatch, combine, sources = self._measured(nb, sm, routed, dispatch, combine)
        attn_proj, core, indexer = self.costs.prefill_attention(
            self, nb, keys, cached_per_token, sm, float(combine)
        )
        parts = (attn_proj, core, shared, routed, gate, dense, dispatch, combine)
        return self._assemble(
            "prefill",
            n,
            mb,
            *parts,
            head_tokens=n / max(prompt_len, 1.0),
            sources=sources,
            indexer=indexer,
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
        p = self._decode_parts(np.asarray(batch_per_gpu, float), np.asarray(mean_kv, float), q)
        nb = batch_per_gpu * q / self.dep.micro_batches
        routed, dispatch, combine, sources = self._measured(
            nb, 1.0, p.routed, p.dispatch, p.combine
        )
        core, indexer = (self.costs.layer_values(self.model, x) for x in (p.core_attn, p.indexer))
        return self._assemble(
            "decode",
            batch_per_gpu,
            self.dep.micro_batches,
            p.attn_proj,
            core,
            p.shared,
            routed,
            p.gate,
            p.dense_mlp,
            dispatch,
            combine,
            head_tokens=batch_per_gpu * q,
            sources=sources,
            indexer=indexer,
        )

    @cached_property
    def _decode_gemm_curves(self):
        """Decode's GEMM seconds per micro-batch on a 1/16-octave grid of tokens per GPU (2^-4 to
        2^20), interpolated per call (the step model runs for every unit and tick): the attention's
        projections, the shared expert, the routed experts. Each curve is made non-decreasing:
        DeepGEMM's throughput, log-interpolated between its published rows, rises faster than the
        rows between 64 and 128 (287 -> 533 TFLOPS), and a kernel is never slower on fewer rows
        than it is on more (it could run them padded)."""
        grid = np.arange(-4.0, 20.0 + 1 / 32, 1 / 16)
        tokens = 2.0**grid
        curves = (
            self.costs.decode_projections(self, tokens),
            self._experts("", tokens, self.model.num_shared_experts),
            self.costs.routed(self, "decode", tokens),
        )
        return (grid, *(np.maximum.accumulate(c) for c in curves))

    def _decode_parts(self, b, kv, queries: int = 1) -> DecodeParts:
        """Per micro-batch parts of a decode step of ``b`` requests per GPU, each with ``queries``
        new tokens (2 when a multi-token-prediction draft is verified) over its ``kv`` cached
        keys: the GEMMs, the all-to-all and the attention FLOPs grow with the tokens, the KV read
        does not (dense attention; sparse attention reads each query's ``index_topk`` selected
        latents, and the request's index keys once)."""
        m = self.model
        mb = self.dep.micro_batches
        nb = b / mb
        tokens = nb * queries
        log_tokens = np.log2(np.maximum(tokens, 1e-9))
        grid, attn_curve, shared_curve, routed_curve = self._decode_gemm_curves
        attn_proj = np.interp(log_tokens, grid, attn_curve)
        core, indexer = self.costs.decode_attention(self, tokens, kv, nb)
        shared = np.interp(log_tokens, grid, shared_curve)
        routed = np.interp(log_tokens, grid, routed_curve)
        gate = self._gemm(
            2 * tokens * m.hidden * m.num_routed_experts, m.hidden * m.num_routed_experts
        )
        dense = self._gemm(2 * tokens * m.dense_mlp_params, m.dense_mlp_params)
        dispatch, combine = (
            self._a2a_low_latency(tokens) if self.gpus > 1 else (0.0 * tokens, 0.0 * tokens)
        )
        return DecodeParts(attn_proj, core, shared, routed, gate, dense, dispatch, combine, indexer)

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
        parts = self._decode_parts(b, kv, queries)
        if self.kernels is not None:
            routed, dispatch, combine = self._measured_many(
                b * queries / mb, parts.routed, parts.dispatch, parts.combine
            )
            parts = parts._replace(routed=routed, dispatch=dispatch, combine=combine)
        head = self._gemm(2 * b * queries * m.hidden * m.vocab, m.hidden * m.vocab)
        return self.costs.decode_layers_s(self, mb, parts) + head + self.eff.step_overhead_s

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
        moe_layer = overlapped(mb, attention, f(shared) + f(routed), f(dispatch), f(combine))
        layer = np.where(is_moe, moe_layer, compute)
        head = float(self._gemm(2 * head_tokens * m.hidden * m.vocab, m.hidden * m.vocab))
        overhead = self.eff.step_overhead_s
        if phase == "prefill":
            overhead += self.eff.prompt_overhead_s * head_tokens
        step = float(layer.sum()) + head + overhead
        return LayerBreakdown(
            phase, parts, compute, comm, layer, head, overhead, step, float(n), sources or {}
        )
