"""What is being served on what: model shape, GPU/node hardware, and a prefill or decode deployment unit.

Presets: :data:`MODELS` (``deepseek-v3``, ``deepseek-v3.2``, ``deepseek-v4-flash`` and
``deepseek-v4-pro``, each built from DeepSeek's published ``config.json``, shipped as data:
:func:`model`), :data:`HARDWARE` (``h800`` with DeepSeek's
published figures, ``h100``/``h200``/``b200`` with vendor peak figures), :func:`deepseek_prefill_unit`
and :func:`deepseek_decode_unit` (the units DeepSeek described on 2025-02-28).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeinfra.errors import InputError

# The byte formats of a cached entry and the published configs are the architecture's arithmetic
# (moeinfra.serving.arch), described once; re-exported here for the serving model's callers.
from moeinfra.serving.arch import (
    CSA,
    KV_CACHE_DTYPES,
    SLIDING,
    Architecture,
    index_key_bytes,
    mla_latent_bytes,
    published,
    published_config,
)

#: Bytes per weight of DeepSeek-V4's routed experts: MXFP4, two E2M1 values a byte and one UE8M0
#: scale per 32 values (the published checkpoints' ``weight_scale_inv``).
FP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32


@dataclass(frozen=True)
class ModelSpec:
    """A DeepSeek-V3-style MLA + MoE transformer (dimensions in elements, not bytes).

    ``index_n_heads`` / ``index_head_dim`` / ``index_topk``: DeepSeek Sparse Attention's lightning
    indexer (V3.2: 64 heads of 128 dimensions, top 2,048 tokens); 0 for dense attention (V3).
    ``kv_cache_dtype``: how the cache is stored (:data:`KV_CACHE_DTYPES`), a choice of the serving
    engine rather than of the architecture, kept here because every byte count reads it.
    ``arch``: DeepSeek-V4's :class:`~moeinfra.serving.arch.Architecture` (None for the MLA models):
    its layers differ by kind (window, CSA, HCA), so the performance model reads them there; the
    MLA fields are 0 for it (:meth:`from_architecture`). ``max_context_tokens``: the longest
    request served (prompt and answer): 128K for V3 and V3.2 as DeepSeek serves them, V4's
    published ``max_position_embeddings`` (1,048,576).
    """

    name: str = "deepseek-v3"
    num_layers: int = 61
    num_dense_layers: int = 3
    hidden: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_routed_experts: int = 256
    num_expert_groups: int = 8
    experts_per_token: int = 8
    groups_per_token: int = 4
    num_shared_experts: int = 1
    moe_intermediate: int = 2048
    dense_intermediate: int = 18432
    vocab: int = 129_280
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    kv_cache_dtype: str = "bf16"
    arch: Architecture | None = None
    max_context_tokens: int = 131_072

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden",
            "num_heads",
            "num_routed_experts",
            "experts_per_token",
        ):
            if getattr(self, name) < 1:
                raise InputError(f"ModelSpec.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise InputError(
                f"ModelSpec.num_dense_layers={self.num_dense_layers} must be in 0..{self.num_layers}"
            )
        indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if min(indexer) < 0 or (any(indexer) and not all(indexer)):
            raise InputError(
                f"ModelSpec index_n_heads={self.index_n_heads}, index_head_dim="
                f"{self.index_head_dim}, index_topk={self.index_topk}: all > 0 (sparse attention) "
                "or all 0 (dense)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InputError(
                f"ModelSpec.kv_cache_dtype={self.kv_cache_dtype!r} is not one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )

    @classmethod
    def from_config(cls, config: dict, name: str = "model") -> ModelSpec:
        """The spec of a DeepSeek-V3-style ``config.json`` (Hugging Face keys; a V3.2 config's
        ``index_n_heads``, ``index_head_dim`` and ``index_topk`` make it sparse). Raises
        InputError naming a missing or bad key."""
        try:
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            return cls(
                name=name,
                num_layers=layers,
                num_dense_layers=min(int(config.get("first_k_dense_replace", 0)), layers),
                hidden=hidden,
                num_heads=int(config["num_attention_heads"]),
                q_lora_rank=int(config.get("q_lora_rank") or hidden),
                kv_lora_rank=int(config["kv_lora_rank"]),
                qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                v_head_dim=int(config["v_head_dim"]),
                num_routed_experts=int(config["n_routed_experts"]),
                num_expert_groups=int(config.get("n_group") or 1),
                experts_per_token=int(config["num_experts_per_tok"]),
                groups_per_token=int(config.get("topk_group") or 1),
                num_shared_experts=int(config.get("n_shared_experts") or 0),
                moe_intermediate=int(config["moe_intermediate_size"]),
                dense_intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                index_n_heads=int(config.get("index_n_heads") or 0),
                index_head_dim=int(config.get("index_head_dim") or 0),
                index_topk=int(config.get("index_topk") or 0),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"config.json of {name}: missing or bad key ({err!r})") from None

    @classmethod
    def from_architecture(cls, arch: Architecture, max_context_tokens: int = 1 << 20) -> ModelSpec:
        """The spec of a DeepSeek-V4 architecture: its MoE and indexer dimensions here, its
        attention (per layer kind) read from ``arch``. No dense layers, no expert groups (V4
        routes each token to ``experts_per_token`` of all experts: no node limit)."""
        if not arch.v4:
            raise InputError(f"{arch.name}: from_architecture takes a DeepSeek-V4 architecture")
        return cls(
            name=arch.name,
            num_layers=arch.num_layers,
            num_dense_layers=0,
            hidden=arch.hidden,
            num_heads=arch.num_heads,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=0,
            qk_nope_head_dim=0,
            qk_rope_head_dim=arch.qk_rope_head_dim,
            v_head_dim=0,
            num_routed_experts=arch.num_routed_experts,
            num_expert_groups=1,
            experts_per_token=arch.experts_per_token,
            groups_per_token=1,
            num_shared_experts=arch.num_shared_experts,
            moe_intermediate=arch.moe_intermediate,
            dense_intermediate=0,
            vocab=arch.vocab,
            index_n_heads=arch.index_n_heads,
            index_head_dim=arch.index_head_dim,
            index_topk=arch.index_topk,
            arch=arch,
            max_context_tokens=max_context_tokens,
        )

    @property
    def v4(self) -> bool:
        """True for DeepSeek-V4 (window + compressed attention, :attr:`arch`)."""
        return self.arch is not None

    def layer_kinds(self) -> tuple[str, ...]:
        """V4's kind of each of :attr:`num_layers` layers: the architecture's, and for a
        multi-token-prediction layer the performance model adds, the window alone (the published
        configs' ``compress_ratios`` give the MTP layer ratio 0)."""
        if self.arch is None:
            raise InputError(f"{self.name} is not a DeepSeek-V4 model")
        kinds = self.arch.layer_kinds
        return kinds + (SLIDING,) * (self.num_layers - len(kinds))

    @property
    def kv_bytes_per_request(self) -> float:
        """KV bytes a request holds whatever its length (0 for MLA): V4's window, ``sliding_window``
        entries per layer (at most; fewer below that context), and its compressors' open-window
        state (:attr:`Architecture.compressor_state_bytes`). With :attr:`kv_bytes_per_token`,
        ``kv_bytes_per_request + context x kv_bytes_per_token`` bounds :meth:`kv_bytes` from
        above, by less than one window (Flash in FP8: 15.2 MB + 3,524 bytes per token)."""
        if self.arch is None:
            return 0.0
        a = self.arch
        window = len(self.layer_kinds()) * a.sliding_window * a.entry_bytes(self.kv_cache_dtype)
        return float(window + a.compressor_state_bytes)

    def kv_bytes(self, context: float) -> float:
        """KV-cache bytes of one request of ``context`` tokens (MLA: ``context`` x
        :attr:`kv_bytes_per_token`; V4: :meth:`Architecture.kv_bytes` plus the compressor state)."""
        if self.arch is None:
            return float(context * self.kv_bytes_per_token)
        a = self.arch
        extra = self.num_layers - a.num_layers  # the MTP layer: a window
        window = extra * min(context, a.sliding_window) * a.entry_bytes(self.kv_cache_dtype)
        return float(
            a.kv_bytes(int(context), self.kv_cache_dtype) + window + a.compressor_state_bytes
        )

    def with_kv_cache_dtype(self, dtype: str) -> ModelSpec:
        """This model with its cache stored as ``dtype`` (:data:`KV_CACHE_DTYPES`)."""
        if dtype not in KV_CACHE_DTYPES:
            raise InputError(f"kv_cache_dtype={dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        return replace(self, kv_cache_dtype=dtype)

    @property
    def sparse(self) -> bool:
        """True for DeepSeek Sparse Attention (a lightning indexer selects ``index_topk`` keys)."""
        return self.index_topk > 0

    @property
    def model_type(self) -> str:
        """``config.json``'s ``model_type`` of this architecture: ``deepseek_v4``,
        ``deepseek_v32`` (V3's shape with sparse attention) or ``deepseek_v3``."""
        if self.arch is not None:
            return self.arch.model_type
        return "deepseek_v32" if self.sparse else "deepseek_v3"

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def mla_params(self) -> int:
        """Parameters of one MLA block's projections (q down/up, kv down/up, output)."""
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        return (
            self.hidden * self.q_lora_rank
            + self.q_lora_rank * self.num_heads * qk_head
            + self.hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            + self.num_heads * self.v_head_dim * self.hidden
        )

    @property
    def indexer_params(self) -> int:
        """Parameters of one layer's lightning indexer (0 when dense): its query up-projection
        (q_lora_rank -> heads x head_dim), key projection (hidden -> head_dim) and per-head weight
        projection (hidden -> heads); 13.96M for V3.2."""
        heads, dim = self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * heads * dim + self.hidden * dim + self.hidden * heads

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention: MLA's projections plus the indexer's."""
        return self.mla_params + self.indexer_params

    @property
    def expert_params(self) -> int:
        """Parameters of one (routed or shared) expert: gate, up and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def kv_values_per_token_layer(self) -> int:
        """Compressed MLA KV cache entries per token per layer (512 latent + 64 RoPE = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_bytes_per_token_layer(self) -> int:
        """Bytes of one token's MLA latent (with its RoPE key) in one layer's cache: 1,152 in
        BF16; in FP8 576 (dense) or 656 (sparse, FlashMLA's ``fp8_ds_mla``: 512 FP8 values, 4
        float32 scales, 64 BF16 RoPE values)."""
        return mla_latent_bytes(
            self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dtype, self.sparse
        )

    @property
    def index_key_bytes_per_token_layer(self) -> int:
        """Bytes of one token's index key in one layer's cache (0 when dense): 256 in BF16, 132 in
        FP8 (128 FP8 values and one float32 scale per 128, as vLLM and SGLang store it)."""
        if not self.sparse:
            return 0
        return index_key_bytes(self.index_head_dim, self.kv_cache_dtype, fp4=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers: latent + index key per layer x layers. BF16:
        1,152 x 61 = 70,272 for V3, (1,152 + 256) x 61 = 85,888 for V3.2; FP8: 576 x 61 = 35,136
        for V3, (656 + 132) x 61 = 48,068 for V3.2. V4: the compressed entries' share, every
        layer's ``(entry + index key) / ratio`` (its window is :attr:`kv_bytes_per_request`)."""
        if self.arch is not None:
            a = self.arch
            entry, key = a.entry_bytes(self.kv_cache_dtype), a.index_key_bytes(self.kv_cache_dtype)
            return sum(
                (entry + (key if kind == CSA else 0)) / ratio
                for kind, ratio in zip(a.layer_kinds, a.compress_ratios, strict=True)
                if ratio
            )
        per_layer = self.latent_bytes_per_token_layer + self.index_key_bytes_per_token_layer
        return per_layer * self.num_layers

    @property
    def activated_params(self) -> int:
        """Parameters touched per token (without embeddings), ~37B for V3."""
        per_moe = (self.num_shared_experts + self.experts_per_token) * self.expert_params
        return (
            self.num_layers * self.attention_params
            + self.num_moe_layers * per_moe
            + (self.num_dense_layers * self.dense_mlp_params)
            + self.hidden * self.vocab
        )


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU node. Throughputs are peak figures; achieved fractions live in :class:`Efficiency`."""

    name: str
    gpus_per_node: int
    fp8_tflops: float
    bf16_tflops: float
    hbm_gb: float
    hbm_tb_per_s: float
    nvlink_gb_per_s: float
    rdma_gb_per_s: float
    num_sms: int
    gpu_hour_usd: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "gpus_per_node",
            "fp8_tflops",
            "bf16_tflops",
            "hbm_gb",
            "hbm_tb_per_s",
            "nvlink_gb_per_s",
            "rdma_gb_per_s",
            "num_sms",
        ):
            if getattr(self, name) <= 0:
                raise InputError(f"HardwareSpec.{name}={getattr(self, name)} must be > 0")
        if self.gpu_hour_usd < 0:
            raise InputError(f"HardwareSpec.gpu_hour_usd={self.gpu_hour_usd} must be >= 0")

    @property
    def node_hour_usd(self) -> float:
        return self.gpu_hour_usd * self.gpus_per_node


#: Architectures served, each from DeepSeek's published ``config.json``: DeepSeek-V3 (also
#: V3.1-Terminus, R1: the same shape), DeepSeek-V3.2 (V3.2-Exp's config: V3 plus the indexer),
#: DeepSeek-V4-Flash and V4-Pro (:func:`moeinfra.serving.arch.published`).
MODELS: dict[str, ModelSpec] = {
    "deepseek-v3": ModelSpec.from_config(published_config("deepseek-v3"), "deepseek-v3"),
    "deepseek-v3.2": ModelSpec.from_config(published_config("deepseek-v3.2-exp"), "deepseek-v3.2"),
} | {
    name: ModelSpec.from_architecture(
        published(name), published_config(name)["max_position_embeddings"]
    )
    for name in ("deepseek-v4-flash", "deepseek-v4-pro")
}
DEEPSEEK_V3 = MODELS["deepseek-v3"]
DEEPSEEK_V32 = MODELS["deepseek-v3.2"]


def model(name: str, kv_cache_dtype: str = "bf16") -> ModelSpec:
    """The architecture called ``name`` (:data:`MODELS`), its cache stored as ``kv_cache_dtype``."""
    if name not in MODELS:
        raise InputError(f"model={name!r} is not one of {', '.join(MODELS)}")
    return MODELS[name].with_kv_cache_dtype(kv_cache_dtype)


HARDWARE: dict[str, HardwareSpec] = {
    # DeepSeek's published H800 figures (REFERENCE.md "Hardware and kernel figures").
    "h800": HardwareSpec("h800", 8, 1979.0, 989.0, 80.0, 3.35, 160.0, 50.0, 132, 2.0),
    # Vendor dense peak figures (NVIDIA data sheets, SXM parts, no sparsity); 400 Gb/s NIC per GPU.
    "h100": HardwareSpec("h100", 8, 1979.0, 989.0, 80.0, 3.35, 450.0, 50.0, 132, 2.0),
    "h200": HardwareSpec("h200", 8, 1979.0, 989.0, 141.0, 4.8, 450.0, 50.0, 132, 2.5),
    # B200: 4.5 PFLOPS dense FP8, 2.25 PFLOPS dense BF16, 180 GB at 8 TB/s, NVLink 5 (900 GB/s/dir).
    # GPU-hour prices other than DeepSeek's $2 for H800 are illustrative rental prices; give yours
    # with priced_hardware("b200", gpu_hour_usd) or the CLI's --gpu-hour-usd.
    "b200": HardwareSpec("b200", 8, 4500.0, 2250.0, 180.0, 8.0, 900.0, 50.0, 148, 4.0),
}


def hardware(name: str) -> HardwareSpec:
    """The preset called ``name`` (case-insensitive)."""
    key = name.lower()
    if key not in HARDWARE:
        raise InputError(f"hardware={name!r} is not one of {', '.join(HARDWARE)}")
    return HARDWARE[key]


def priced_hardware(name: str, gpu_hour_usd: float | None = None) -> HardwareSpec:
    """The preset called ``name``, at ``gpu_hour_usd`` per GPU-hour if given."""
    hw = hardware(name)
    if gpu_hour_usd is None:
        return hw
    if not (math.isfinite(gpu_hour_usd) and gpu_hour_usd >= 0):
        raise InputError(f"gpu_hour_usd={gpu_hour_usd} must be a finite number >= 0")
    return replace(hw, gpu_hour_usd=gpu_hour_usd)


@dataclass(frozen=True)
class Deployment:
    """One deployment unit of a phase: ``nodes`` nodes running EP=DP=``nodes * gpus_per_node``.

    Attributes:
        phase: ``"prefill"`` or ``"decode"``.
        nodes: nodes per unit (DeepSeek: 4 prefill, 18 decode).
        redundant_experts: extra routed-expert slots per layer (DeepSeek: 32 in both phases).
        micro_batches: 2 (dual micro-batch overlap in both phases).
        tokens_per_gpu: prefill only, tokens a GPU takes per forward step (DeepSeek's profile: 16K).
        load_kind / load_skew: synthetic expert-load skew fed to EPLB for the expert imbalance.
        mtp_acceptance: decode only, the share of multi-token-prediction drafts accepted (0: MTP
            off; DeepSeek-V3 report: 0.85-0.9); each step verifies two tokens per request.
        max_batch_per_gpu: decode only, running requests per GPU at most (None: as many as the KV
            cache holds); the rest wait for a slot.
    """

    phase: str
    nodes: int
    redundant_experts: int = 32
    micro_batches: int = 2
    tokens_per_gpu: int = 16_384
    load_kind: str = "lognormal"
    load_skew: float | None = None
    load_seed: int = 0
    mtp_acceptance: float = 0.0
    max_batch_per_gpu: float | None = None

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise InputError(f"Deployment.phase={self.phase!r} must be 'prefill' or 'decode'")
        if self.nodes < 1:
            raise InputError(f"Deployment.nodes={self.nodes} must be >= 1")
        if self.redundant_experts < 0:
            raise InputError(f"Deployment.redundant_experts={self.redundant_experts} must be >= 0")
        if self.micro_batches not in (1, 2):
            raise InputError(f"Deployment.micro_batches={self.micro_batches} must be 1 or 2")
        if self.tokens_per_gpu < 1:
            raise InputError(f"Deployment.tokens_per_gpu={self.tokens_per_gpu} must be >= 1")
        if not 0.0 <= self.mtp_acceptance < 1.0:
            raise InputError(
                f"Deployment.mtp_acceptance={self.mtp_acceptance} must be in [0, 1) (0: no MTP)"
            )
        if self.max_batch_per_gpu is not None and not (
            math.isfinite(self.max_batch_per_gpu) and self.max_batch_per_gpu > 0
        ):
            raise InputError(
                f"Deployment.max_batch_per_gpu={self.max_batch_per_gpu} must be a finite number "
                "> 0 (or None: no limit)"
            )
        if self.phase == "prefill" and (self.mtp_acceptance or self.max_batch_per_gpu is not None):
            raise InputError(
                "Deployment.mtp_acceptance and max_batch_per_gpu apply to decode units only"
            )

    @property
    def tokens_per_step(self) -> float:
        """Output tokens a request gains per decode step (1 + the accepted drafts)."""
        return 1.0 + self.mtp_acceptance

    def gpus(self, hw: HardwareSpec) -> int:
        return self.nodes * hw.gpus_per_node

    def with_(self, **changes: object) -> Deployment:
        return replace(self, **changes)  # type: ignore[arg-type]


def fitting_redundant_experts(
    nodes: int, gpus_per_node: int = 8, routed_experts: int = 256, at_least: int = 32
) -> int:
    """Fewest redundant expert slots, at least ``at_least`` (DeepSeek's 32), that make routed +
    redundant slots a multiple of the unit's GPUs (every GPU holds as many): 32 on 4 or 18 nodes
    of 8 GPUs, 64 on 8 nodes."""
    return at_least + (-(routed_experts + at_least)) % (nodes * gpus_per_node)


def deepseek_prefill_unit() -> Deployment:
    """Prefill unit DeepSeek published: 4 nodes, EP32/DP32, 32 redundant experts (9 per GPU)."""
    return Deployment("prefill", nodes=4)


def deepseek_decode_unit() -> Deployment:
    """Decode unit DeepSeek published: 18 nodes, EP144/DP144, 32 redundant experts (2 per GPU)."""
    return Deployment("decode", nodes=18)


@dataclass(frozen=True)
class ExpertBalance:
    """Expert imbalance of a deployment under EPLB, computed once per deployment.

    ``imbalance`` = heaviest GPU's routed-expert load / mean (averaged over MoE layers) — the factor
    on the routed-expert part of the MoE cost. ``nodes_per_token`` / ``gpus_per_token``: distinct
    nodes / GPUs a token's experts sit on.
    """

    imbalance: float
    nodes_per_token: float
    slots_per_gpu: int
    gpus_per_token: float
    summary: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _BalanceKey:
    model: ModelSpec
    gpus: int
    nodes: int
    redundant_experts: int
    load: tuple[str, float | None, int]


_BALANCE_CACHE: dict[_BalanceKey, ExpertBalance] = {}


def expert_balance(model: ModelSpec, hw: HardwareSpec, dep: Deployment) -> ExpertBalance:
    """Run EPLB (``moeinfra.eplb.rebalance``) on a synthetic skewed load and evaluate the plan.

    The load has the skew of ``dep.load_kind``/``dep.load_skew`` over ``[moe_layers, experts]``.
    Raises InputError when the slots cannot be spread evenly over the GPUs.
    """
    from moeinfra.eplb import evaluate, rebalance
    from moeinfra.eplb.synthetic import synthetic_load

    gpus = dep.gpus(hw)
    key = _BalanceKey(
        model, gpus, dep.nodes, dep.redundant_experts, (dep.load_kind, dep.load_skew, dep.load_seed)
    )
    if key in _BALANCE_CACHE:
        return _BALANCE_CACHE[key]
    slots = model.num_routed_experts + dep.redundant_experts
    if slots % gpus:
        raise InputError(
            f"{dep.phase} unit: routed experts + redundant_experts = {slots} must be a multiple "
            f"of its {gpus} GPUs"
        )
    load = synthetic_load(
        dep.load_kind,
        max(model.num_moe_layers, 1),
        model.num_routed_experts,
        experts_per_token=model.experts_per_token,
        skew=dep.load_skew,
        seed=dep.load_seed,
    )
    plan = rebalance(load, slots, model.num_expert_groups, dep.nodes, gpus)
    summary = evaluate(
        plan,
        load,
        groups_per_token=model.groups_per_token,
        experts_per_token=model.experts_per_token,
    ).summary()
    # node-limited routing (V3: a token's experts in at most 4 groups) caps the nodes a token
    # reaches; without groups (V4) only its experts do
    reach = model.groups_per_token if model.num_expert_groups > 1 else model.experts_per_token
    result = ExpertBalance(
        imbalance=float(summary["max_over_mean"]),
        nodes_per_token=float(min(summary["nodes_per_token"], reach, dep.nodes)),
        slots_per_gpu=slots // gpus,
        gpus_per_token=float(min(summary["gpus_per_token"], model.experts_per_token, gpus)),
        summary=summary,
    )
    _BALANCE_CACHE[key] = result
    return result
