"""Read a Hugging Face ``config.json`` of a DeepSeek-V3-architecture checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moeinfra.errors import CheckpointError, InputError
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.rope import Yarn

# DeepSeek-V4's layer kinds
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class V4Attention:
    """DeepSeek-V4's attention and residual-stream knobs (``config.json``)."""

    head_dim: int
    rope_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer, 0 for a sliding-only layer
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    hash_layers: tuple[bool, ...]

    @property
    def has_csa(self) -> bool:
        return CSA in self.layer_kinds

    @property
    def ratios(self) -> tuple[int, ...]:
        """The distinct compression ratios in use."""
        return tuple(sorted({r for r in self.compress_ratios if r}))


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): ``heads`` scoring heads of
    ``head_dim`` (the first ``qk_rope_head_dim`` of them rotated), one key of ``head_dim`` per
    token, and the ``topk`` earlier tokens each query's MLA attends to."""

    heads: int
    head_dim: int
    topk: int

    @classmethod
    def from_hf(cls, raw: dict, source: str) -> IndexerConfig:
        """From ``config.json``'s ``index_n_heads``, ``index_head_dim``, ``index_topk``."""
        values = {}
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            if key not in raw:
                raise CheckpointError(f"{source}: required key {key!r} is missing")
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"{source}: {key}={value!r} must be an integer > 0")
            values[key] = value
        rope = int(raw["qk_rope_head_dim"])
        if values["index_head_dim"] < rope:
            raise CheckpointError(
                f"{source}: index_head_dim={values['index_head_dim']} must be >= "
                f"qk_rope_head_dim={rope} (the indexer rotates its first qk_rope_head_dim dims)"
            )
        return cls(values["index_n_heads"], values["index_head_dim"], values["index_topk"])


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from ``config.json``.

    ``block`` holds the sizes of one decoder block (MLA + MoE) in :mod:`moeinfra.moe`'s terms;
    ``num_layers`` is ``num_hidden_layers`` (the MTP layers after them are not loaded);
    ``first_k_dense_replace`` layers have a dense SwiGLU MLP of ``intermediate_size`` instead of MoE;
    ``indexer``: DeepSeek-V3.2's sparse-attention indexer (None: dense MLA, DeepSeek-V3);
    ``v4``: DeepSeek-V4's attention and residual streams (None: MLA).
    """

    model_type: str
    block: MoEConfig
    vocab_size: int
    num_layers: int
    first_k_dense_replace: int
    intermediate_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    num_mtp_layers: int
    quantization: dict | None
    torch_dtype: str
    indexer: IndexerConfig | None = None
    v4: V4Attention | None = None

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.block.kv_lora_rank + self.block.qk_rope_head_dim


def _rope_scaling(raw: dict) -> tuple[float, Yarn | None]:
    """``(rope_theta, yarn)`` from either the classic keys or transformers 5's ``rope_parameters``."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise CheckpointError(
            f"config.json: rope_scaling type {kind!r} is not supported; use 'yarn' or none"
        )
    return theta, Yarn.from_hf(scaling)


def model_fields(raw: dict) -> dict:
    """The :class:`ModelConfig` fields every architecture reads alike from ``config.json``
    (vocabulary, context, special tokens, MTP layers, quantization, dtype); raises ``KeyError``
    for a missing required key."""
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return {
        "vocab_size": int(raw["vocab_size"]),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "num_mtp_layers": int(raw.get("num_nextn_predict_layers", 0) or 0),
        "quantization": raw.get("quantization_config"),
        "torch_dtype": str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
    }


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from the parsed ``config.json`` dict; ``source`` names it in errors."""
    try:
        if raw.get("q_lora_rank") is None:
            raise CheckpointError(
                f"{source}: q_lora_rank=None (no query compression) is not supported"
            )
        theta, yarn = _rope_scaling(raw)
        block = MoEConfig(
            hidden_size=int(raw["hidden_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_routed_experts=int(raw["n_routed_experts"]),
            num_shared_experts=int(raw.get("n_shared_experts") or 0),
            experts_per_token=int(raw["num_experts_per_tok"]),
            num_expert_groups=int(raw.get("n_group") or 1),
            groups_per_token=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring=raw.get("scoring_func", "sigmoid"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            num_layers=int(raw["num_hidden_layers"]),
            rope_theta=theta,
            rope_scaling=yarn,
            rope_interleave=bool(raw.get("rope_interleave", True)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        )
        config = ModelConfig(
            model_type=raw["model_type"],
            block=block,
            num_layers=int(raw["num_hidden_layers"]),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            intermediate_size=int(raw["intermediate_size"]),
            **model_fields(raw),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {exc}") from None
    if not 0 <= config.first_k_dense_replace <= config.num_layers:
        raise CheckpointError(
            f"{source}: first_k_dense_replace={config.first_k_dense_replace} must be in "
            f"0..num_hidden_layers={config.num_layers}"
        )
    if config.quantization and config.quantization.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{source}: quantization_config.quant_method="
            f"{config.quantization.get('quant_method')!r} is not supported; use 'fp8' or none"
        )
    return config


def read_config(model_dir: Path) -> dict:
    """The parsed ``config.json`` of ``model_dir`` (raises :class:`CheckpointError` naming it)."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model={str(model_dir)!r} is not a folder")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint folder has config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if "model_type" not in raw:
        raise CheckpointError(f"{path}: required key 'model_type' is missing")
    return raw


PUBLISHED = ("deepseek-v3", "deepseek-v3.2-exp", "deepseek-v4-flash", "deepseek-v4-pro")


def published_config(name: str) -> dict:
    """DeepSeek's released ``config.json`` of ``name`` (one of :data:`PUBLISHED`), shipped as data
    (read by :func:`moeinfra.serving.arch.published_config`, the one reader of these files)."""
    from moeinfra.serving.arch import published_config as read

    if name not in PUBLISHED:
        raise InputError(f"name={name!r} is not a published config; use one of {PUBLISHED}")
    return read(name)
