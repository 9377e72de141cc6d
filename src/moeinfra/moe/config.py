"""``MoEConfig``: DeepSeek-V3's MoE and MLA knobs, with the real preset and a tiny CPU preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from moeinfra.errors import InputError
from moeinfra.moe.rope import Yarn


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of one DeepSeek-V3-style decoder block (MLA attention + MoE).

    Attributes:
        hidden_size: model width ``H``.
        moe_intermediate_size: intermediate width of each routed (and shared) expert.
        num_routed_experts: routed experts ``E``.
        num_shared_experts: shared experts, run on every token (fused into one SwiGLU of
            ``num_shared_experts * moe_intermediate_size``, as DeepSeek-V3 does).
        experts_per_token: ``top_k`` routed experts per token.
        num_expert_groups: expert groups (``E`` must be a multiple).
        groups_per_token: at most this many groups are used by one token (group-limited routing).
        routed_scaling_factor: routed weights are multiplied by this after normalisation.
        scoring: ``"sigmoid"`` (DeepSeek-V3), ``"softmax"`` (DeepSeek-V2) or ``"sqrtsoftplus"``
            (DeepSeek-V4).
        norm_topk_prob: normalise the top-k weights to sum to 1 before scaling (None: as DeepSeek's
            reference gate, with sigmoid scoring only).
        num_attention_heads: MLA heads.
        q_lora_rank: MLA's low-rank q compression.
        kv_lora_rank: MLA's low-rank kv compression (the latent cached per token).
        qk_nope_head_dim: per-head q/k dims without RoPE.
        qk_rope_head_dim: decoupled RoPE dims per head (the RoPE key is cached per token).
        v_head_dim: per-head value dims.
        num_layers: decoder blocks in the small model used by the overlap schedules.
        rope_theta: RoPE base.
        rope_scaling: YaRN extension (None: plain RoPE).
        rope_interleave: RoPE pairs are adjacent dims (DeepSeek's layout) rather than halves.
        rms_norm_eps: RMSNorm epsilon.
        swiglu_limit: DeepSeek-V4's clamp of the experts' SwiGLU: gate <= limit, |up| <= limit
            (None: no clamp, DeepSeek-V3).
    """

    hidden_size: int
    moe_intermediate_size: int
    num_routed_experts: int
    num_shared_experts: int
    experts_per_token: int
    num_expert_groups: int
    groups_per_token: int
    routed_scaling_factor: float
    scoring: str = "sigmoid"
    norm_topk_prob: bool | None = None
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_layers: int = 1
    rope_theta: float = 10000.0
    rope_scaling: Yarn | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        positive = (
            "hidden_size",
            "moe_intermediate_size",
            "num_routed_experts",
            "experts_per_token",
            "num_expert_groups",
            "groups_per_token",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_layers",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name}={value!r} must be a positive integer")
        if self.num_shared_experts < 0:
            raise InputError(f"num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise InputError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 0")
        if self.num_routed_experts % self.num_expert_groups:
            raise InputError(
                f"num_routed_experts={self.num_routed_experts} must be a multiple of "
                f"num_expert_groups={self.num_expert_groups}"
            )
        if self.groups_per_token > self.num_expert_groups:
            raise InputError(
                f"groups_per_token={self.groups_per_token} must be <= "
                f"num_expert_groups={self.num_expert_groups}"
            )
        per_group = self.num_routed_experts // self.num_expert_groups
        if self.experts_per_token > self.groups_per_token * per_group:
            raise InputError(
                f"experts_per_token={self.experts_per_token} must be <= groups_per_token * experts "
                f"per group = {self.groups_per_token * per_group}"
            )
        if self.num_expert_groups > 1 and per_group < 2:
            raise InputError(
                f"group-limited routing ranks groups by their top-2 scores: each of the "
                f"num_expert_groups={self.num_expert_groups} groups needs >= 2 experts, has {per_group}"
            )
        if self.scoring not in ("sigmoid", "softmax", "sqrtsoftplus"):
            raise InputError(
                f"scoring={self.scoring!r} is not allowed; use 'sigmoid', 'softmax' or "
                "'sqrtsoftplus'"
            )
        if not self.routed_scaling_factor > 0:
            raise InputError(f"routed_scaling_factor={self.routed_scaling_factor} must be > 0")

    @property
    def experts_per_group(self) -> int:
        return self.num_routed_experts // self.num_expert_groups

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def parameter_count(self) -> int:
        """Parameters of the decoder (``num_layers`` blocks of MLA + MoE, norms left out)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        heads = self.num_attention_heads
        experts = (self.num_routed_experts + self.num_shared_experts) * 3 * h * i
        gate = self.num_routed_experts * h
        attention = (
            h * self.q_lora_rank
            + self.q_lora_rank * heads * self.qk_head_dim
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * h
        )
        return self.num_layers * (experts + gate + attention)

    def replace(self, **changes) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def deepseek_v3() -> MoEConfig:
    """DeepSeek-V3's published sizes (one MoE layer; the real model has 58 of them)."""
    return MoEConfig(
        hidden_size=7168,
        moe_intermediate_size=2048,
        num_routed_experts=256,
        num_shared_experts=1,
        experts_per_token=8,
        num_expert_groups=8,
        groups_per_token=4,
        routed_scaling_factor=2.5,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=1,
    )


def tiny() -> MoEConfig:
    """Same structure as DeepSeek-V3 at a size that runs in milliseconds on a CPU."""
    return MoEConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_routed_experts=16,
        num_shared_experts=1,
        experts_per_token=4,
        num_expert_groups=4,
        groups_per_token=2,
        routed_scaling_factor=2.5,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_layers=2,
    )


def small() -> MoEConfig:
    """``tiny`` with 512-wide experts: at ~1,000 tokens per rank a micro-batch's expert compute takes
    longer than a few-ms exchange, as in DeepSeek-V3's prefill, so dual micro-batch overlap has
    compute to hide communication behind (``tiny``'s 32-wide experts are all per-op overhead on a
    CPU). ``moeinfra moe run``'s default."""
    return tiny().replace(moe_intermediate_size=512)


PRESETS = {"tiny": tiny, "small": small, "deepseek_v3": deepseek_v3}


def preset(name: str) -> MoEConfig:
    """Config by preset name (``tiny``, ``small`` or ``deepseek_v3``)."""
    if name not in PRESETS:
        raise InputError(f"preset={name!r} is not known; use one of {sorted(PRESETS)}")
    return PRESETS[name]()
