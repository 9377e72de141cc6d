"""Whether a unit fits in HBM: the weights one GPU holds, the activations of a step, the KV cache
of one full-context request, and the KV capacity left after the weights."""

from __future__ import annotations

from dataclasses import dataclass

from moeinfra.errors import InputError
from moeinfra.serving.perfmodel.all_to_all import token_bytes

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


class MemoryFit:
    """A unit's memory budget per GPU (a base of
    :class:`~moeinfra.serving.perfmodel.step.PerfModel`, which sets what it reads: ``dep``,
    ``hw``, ``eff``, ``model``, the expert ``balance``, the architecture's terms ``costs`` and
    ``_kv_tokens_per_gpu``)."""

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weights resident on one GPU: attention, shared experts, routed-expert slots, dense MLPs
        and the head, as the architecture stores them (:attr:`CostTerms.weight_bytes`)."""
        return self.costs.weight_bytes(self.model, self.balance.slots_per_gpu)

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
        :data:`DECODE_ACTIVATION_BATCH` requests), the residual stream and the attention heads'
        activations (BF16; :attr:`CostTerms.activation_bytes`), the indexer's queries (BF16), and
        for the ``r`` expert rows it receives (``n`` x experts per token x the expert imbalance)
        the dispatch buffer (FP8 with scales), the experts' gate/up output (BF16) and the combine
        buffer (BF16); plus FP32 logits of the rows through the LM head (prefill: one per
        4,096-token prompt; decode: every request). ``max_context``: default the model's longest
        request (``ModelSpec.max_context_tokens``)."""
        m, mb = self.model, self.dep.micro_batches
        max_context = m.max_context_tokens if max_context is None else max_context
        n = float(
            self.dep.tokens_per_gpu if self.dep.phase == "prefill" else DECODE_ACTIVATION_BATCH
        )
        nb = n / mb
        rows = nb * m.experts_per_token * self.balance.imbalance
        dispatch_bytes, combine_bytes = token_bytes(m.hidden)
        per_micro_batch = (
            self.costs.activation_bytes(m, nb)
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
