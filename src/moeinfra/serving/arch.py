"""The arithmetic of a DeepSeek architecture, from its ``config.json``: parameters, KV-cache bytes
and FLOPs per token at a context length.

One torch-free description per architecture (DESIGN.md, "An architecture is described once"),
parsed from a ``config.json`` of ``model_type``

* ``deepseek_v3``: MLA, every token attends to every earlier token's 512 + 64 latent;
* ``deepseek_v32``: the same MLA over the ``index_topk`` earlier tokens a lightning indexer picks
  (the indexer scores them all, one 128-value key per token);
* ``deepseek_v4``: per layer shared-KV multi-query attention over the last ``sliding_window``
  tokens plus compressed entries (``compress_ratios``): CSA (ratio 4) one entry per 4 tokens with a
  lightning indexer over them choosing ``index_topk``, HCA (ratio 128) one entry per 128 tokens,
  all attended; ratio 0 is the window alone.

:meth:`Architecture.params` counts parameters (total, and activated per token),
:meth:`Architecture.kv_bytes` the KV cache of one request (``bf16`` or DeepSeek's low-precision
format ``fp8``), :meth:`Architecture.decode_flops` the FLOPs of one token decoded at a context
length, by part and by the precision its multiplies run in, and their sum in equivalent FP8 FLOPs
(the DeepSeek-V4 report's unit; weights in :data:`FP8_EQUIVALENT`). DeepSeek's published configs
ship as data: :func:`published` builds them by name (:data:`PUBLISHED`). How each number is
counted, and the sources: docs/serving-model.md, "Architectures".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

from moeinfra.errors import InputError

#: Layer kinds: DeepSeek-V3's dense MLA, V3.2's MLA behind an indexer, and DeepSeek-V4's sliding
#: window alone (ratio 0), compressed sparse attention (CSA) and heavily compressed attention (HCA),
#: named as transformers' ``DeepseekV4Config.layer_types`` names them.
MLA, SPARSE_MLA = "mla", "sparse_mla"
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_V4_KIND_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}

#: KV-cache storage formats: ``bf16`` (every cached value in 2 bytes) or ``fp8``, the format the
#: engines store DeepSeek's caches in: V3's 576-value latent in FP8 with one scale per tensor;
#: V3.2's latent in FlashMLA's ``fp8_ds_mla`` layout (512 FP8 values, 4 float32 scales, 64 BF16
#: RoPE values: 656 B) and its index key in FP8 with one float32 scale per 128 values (132 B);
#: V4's entries as its report states (FP8, the 64 RoPE dimensions BF16; vLLM's 584-byte layout with
#: 7 UE8M0 scales in 8 bytes) and its index keys in FP4 with one UE8M0 scale per 32 values (68 B).
KV_CACHE_DTYPES = ("bf16", "fp8")

#: Precisions a multiply runs in (``decode_flops``) and the weight of one FLOP of each in
#: equivalent FP8 FLOPs: the FP8 dense peak over that precision's dense peak. BF16 and TF32: 989
#: and 495 of 1,979 TFLOPS on H800/H100 (B200: 2.25 and 1.1 of 4.5 PFLOPS); ``fp4xfp8``: FP4
#: weights times FP8 activations (V4's routed experts), as FP8 ("the peak FLOPs for FP4 x FP8
#: operations are currently the same as FP8 x FP8", DeepSeek-V4 report, section 1); ``fp4``: both
#: operands FP4 (V4's indexer QK, "multiplied entirely in FP4", section 5.2.1), at FP4's peak of
#: twice FP8's (B200: 9 of 4.5 PFLOPS).
FP8_EQUIVALENT = {"fp8": 1.0, "fp4xfp8": 1.0, "fp4": 0.5, "bf16": 2.0, "tf32": 4.0}

#: Presets: serving name -> file of DeepSeek's published ``config.json`` shipped with the engine
#: (``moeinfra/engine/data/configs/``; README.md there records where each comes from).
PUBLISHED = {
    "deepseek-v3": "deepseek-v3",
    "deepseek-v3.2": "deepseek-v3.2-exp",
    "deepseek-v4-flash": "deepseek-v4-flash",
    "deepseek-v4-pro": "deepseek-v4-pro",
}

#: What each preset's model card or report states: (total, activated) parameters, for the tests.
PUBLISHED_PARAMS = {
    "deepseek-v3": (671e9, 37e9),
    "deepseek-v4-flash": (284e9, 13e9),
    "deepseek-v4-pro": (1.6e12, 49e9),
}


def published_config(file_name: str) -> dict:
    """DeepSeek's released ``config.json`` called ``file_name`` (a value of :data:`PUBLISHED`), read
    as a file from the engine's data: the engine package is not imported."""
    names = sorted(PUBLISHED.values())
    if file_name not in names:
        raise InputError(f"config {file_name!r} is not one of {', '.join(names)}")
    path = resources.files("moeinfra").joinpath(f"engine/data/configs/{file_name}.json")
    return json.loads(path.read_text())


@cache
def published(name: str) -> Architecture:
    """The architecture of preset ``name`` (:data:`PUBLISHED`) from DeepSeek's published config."""
    if name not in PUBLISHED:
        raise InputError(f"model={name!r} is not one of {', '.join(PUBLISHED)}")
    return Architecture.from_config(published_config(PUBLISHED[name]), name)


def _check_dtype(dtype: str) -> None:
    if dtype not in KV_CACHE_DTYPES:
        raise InputError(f"kv_cache_dtype={dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


def mla_latent_bytes(kv_lora_rank: int, rope_dim: int, dtype: str, sparse: bool) -> int:
    """Bytes of one token's MLA latent (``kv_lora_rank`` values and ``rope_dim`` RoPE key values)
    in one layer's cache: 2 per value in BF16; in FP8 one per value (dense: one scale per tensor),
    or for sparse attention FlashMLA's ``fp8_ds_mla`` (FP8 latent, one float32 scale per 128,
    BF16 RoPE): 1,152 / 576 / 656 for 512 + 64."""
    _check_dtype(dtype)
    if dtype == "bf16":
        return 2 * (kv_lora_rank + rope_dim)
    if sparse:
        return kv_lora_rank + 4 * math.ceil(kv_lora_rank / 128) + 2 * rope_dim
    return kv_lora_rank + rope_dim


def v4_entry_bytes(head_dim: int, rope_dim: int, dtype: str) -> int:
    """Bytes of one DeepSeek-V4 KV entry (window or compressed; key and value are one
    ``head_dim`` vector): 2 per value in BF16; ``fp8`` as the V4 report stores it, the non-RoPE
    dimensions in FP8 with one UE8M0 scale per 64 (DeepSeek's ``act_quant(kv[..., :-rd], 64)``)
    padded to 8 bytes, the RoPE dimensions in BF16: 448 + 8 + 128 = 584 (vLLM's ``fp8_ds_mla`` for
    V4)."""
    _check_dtype(dtype)
    if dtype == "bf16":
        return 2 * head_dim
    nope = head_dim - rope_dim
    return nope + 8 * math.ceil(math.ceil(nope / 64) / 8) + 2 * rope_dim


def index_key_bytes(index_head_dim: int, dtype: str, fp4: bool) -> int:
    """Bytes of one cached index key: 2 per value in BF16; ``fp8`` as FP8 with one float32 scale
    per 128 (V3.2: 132 for 128 values) or, ``fp4`` (V4: "cached, loaded, and multiplied entirely in
    FP4"), two values a byte with one UE8M0 scale per 32 (68)."""
    _check_dtype(dtype)
    if dtype == "bf16":
        return 2 * index_head_dim
    if fp4:
        return index_head_dim // 2 + math.ceil(index_head_dim / 32)
    return index_head_dim + 4 * math.ceil(index_head_dim / 128)


@dataclass(frozen=True)
class Params:
    """Parameter counts of the main model (the MTP layers left out; quantization scales and V4's
    hash-routing table ``tid2eid``, a lookup and not a weight, not counted).

    ``total``: every weight; ``activated``: those one token touches, the embedding table (a lookup)
    left out and only ``experts_per_token`` of the routed experts; ``parts``: total by part
    (``embedding``, ``head``, ``attention``, ``indexer``, ``compressor``, ``router``,
    ``routed_experts``, ``shared_experts``, ``dense_mlp``, ``norms_and_mhc``).
    """

    total: int
    activated: int
    parts: dict[str, int]


@dataclass(frozen=True)
class Flops:
    """FLOPs of one decoded token (a multiply-add is 2), ``terms[(part, precision)]``.

    Parts: ``projections`` (attention and indexer weight GEMMs), ``compressor`` (V4's compressor
    projections), ``attention`` (core attention: QK and PV), ``indexer`` (the indexer's QK
    scores), ``moe`` (router, shared and routed experts), ``dense_mlp``, ``mhc`` (V4's
    hyper-connection projections), ``head`` (the LM head). Precisions: :data:`FP8_EQUIVALENT`.
    """

    terms: dict[tuple[str, str], float]

    @property
    def total(self) -> float:
        """FLOPs as counted, every precision alike."""
        return sum(self.terms.values())

    @property
    def equivalent_fp8(self) -> float:
        """FLOPs in equivalent FP8 FLOPs: each weighted by :data:`FP8_EQUIVALENT` of its precision."""
        return sum(f * FP8_EQUIVALENT[p] for (_, p), f in self.terms.items())

    def by_part(self, fp8_equivalent: bool = True) -> dict[str, float]:
        """FLOPs per part, in equivalent FP8 FLOPs unless ``fp8_equivalent`` is False."""
        out: dict[str, float] = {}
        for (part, precision), f in self.terms.items():
            out[part] = out.get(part, 0.0) + f * (
                FP8_EQUIVALENT[precision] if fp8_equivalent else 1
            )
        return out


def _positive(config: dict, key: str, name: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise InputError(f"config.json of {name}: required key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"config.json of {name}: {key}={value!r} must be an integer >= 0")
    return value


def _v4_schedule(config: dict, layers: int, name: str) -> tuple[int, ...]:
    """Per layer compression ratio (0: window only) from DeepSeek's ``compress_ratios`` (one per
    layer, then the MTP layers' entries, dropped) or transformers' ``layer_types`` and
    ``compress_rates``."""
    if config.get("compress_ratios") is not None:
        ratios = tuple(config["compress_ratios"])
        if len(ratios) < layers:
            raise InputError(
                f"config.json of {name}: compress_ratios has {len(ratios)} entries, fewer than "
                f"num_hidden_layers={layers}"
            )
        ratios = ratios[:layers]
        bad = sorted({r for r in ratios if r not in _V4_KIND_OF_RATIO}, key=str)
        if bad:
            raise InputError(
                f"config.json of {name}: compress_ratios values {bad} are not among 0, 4, 128"
            )
        return ratios
    if config.get("layer_types") is not None:
        rates = {CSA: 4, HCA: 128, SLIDING: 0} | dict(config.get("compress_rates") or {})
        kinds = tuple(config["layer_types"])
        if len(kinds) != layers or any(k not in (SLIDING, CSA, HCA) for k in kinds):
            raise InputError(
                f"config.json of {name}: layer_types must list num_hidden_layers={layers} of "
                f"{SLIDING}, {CSA}, {HCA}"
            )
        return tuple(rates[k] for k in kinds)
    raise InputError(
        f"config.json of {name}: required key 'compress_ratios' (or 'layer_types') is missing"
    )


@dataclass(frozen=True)
class Architecture:
    """A DeepSeek-V3, V3.2 or V4 model's shape (dimensions in elements).

    ``layer_kinds`` and ``compress_ratios`` have one entry per layer (MTP layers not included):
    :data:`MLA` / :data:`SPARSE_MLA` with ratio 1 (an entry per token), or V4's :data:`SLIDING`
    (0), :data:`CSA` (4), :data:`HCA` (128). MLA fields are 0 for V4 and V4 fields 0 for MLA;
    the indexer's fields are 0 without one.
    """

    name: str
    model_type: str
    hidden: int
    vocab: int
    num_heads: int
    q_lora_rank: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    moe_intermediate: int
    num_routed_experts: int
    num_shared_experts: int
    experts_per_token: int
    num_dense_layers: int = 0
    dense_intermediate: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    head_dim: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    sliding_window: int = 0
    hc_mult: int = 1
    num_hash_layers: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    num_mtp_layers: int = 0

    @classmethod
    def from_config(cls, config: dict, name: str = "model") -> Architecture:
        """The architecture of a ``config.json`` dict (Hugging Face keys) of ``model_type``
        ``deepseek_v3``, ``deepseek_v32`` or ``deepseek_v4``. Raises InputError naming a missing
        or bad key."""
        model_type = config.get("model_type")
        if model_type not in ("deepseek_v3", "deepseek_v32", "deepseek_v4"):
            raise InputError(
                f"config.json of {name}: model_type={model_type!r} is not one of deepseek_v3, "
                "deepseek_v32, deepseek_v4"
            )

        def get(key: str, default: int | None = None) -> int:
            return _positive(config, key, name, default)

        layers = get("num_hidden_layers")
        common = dict(
            name=name,
            model_type=model_type,
            hidden=get("hidden_size"),
            vocab=get("vocab_size"),
            num_heads=get("num_attention_heads"),
            q_lora_rank=get("q_lora_rank"),
            moe_intermediate=get("moe_intermediate_size"),
            num_routed_experts=get("n_routed_experts"),
            num_shared_experts=get("n_shared_experts", 0),
            experts_per_token=get("num_experts_per_tok"),
            num_mtp_layers=get("num_nextn_predict_layers", 0),
        )
        indexer = dict(
            index_n_heads=get("index_n_heads", 0),
            index_head_dim=get("index_head_dim", 0),
            index_topk=get("index_topk", 0),
        )
        if model_type == "deepseek_v4":
            ratios = _v4_schedule(config, layers, name)
            hash_layers = config.get("num_hash_layers")
            if hash_layers is None and config.get("mlp_layer_types") is not None:
                hash_layers = list(config["mlp_layer_types"]).count("hash_moe")
            arch = cls(
                **common,
                **indexer,
                layer_kinds=tuple(_V4_KIND_OF_RATIO[r] for r in ratios),
                compress_ratios=ratios,
                qk_rope_head_dim=get("qk_rope_head_dim", 64),
                head_dim=get("head_dim"),
                o_groups=get("o_groups"),
                o_lora_rank=get("o_lora_rank"),
                sliding_window=get("sliding_window"),
                hc_mult=get("hc_mult", 1),
                num_hash_layers=min(hash_layers or 0, layers),
            )
        else:
            sparse = model_type == "deepseek_v32"
            arch = cls(
                **common,
                **(indexer if sparse else {}),
                layer_kinds=(SPARSE_MLA if sparse else MLA,) * layers,
                compress_ratios=(1,) * layers,
                num_dense_layers=min(get("first_k_dense_replace", 0), layers),
                dense_intermediate=get("intermediate_size"),
                kv_lora_rank=get("kv_lora_rank"),
                qk_nope_head_dim=get("qk_nope_head_dim"),
                qk_rope_head_dim=get("qk_rope_head_dim"),
                v_head_dim=get("v_head_dim"),
            )
        arch._validate()
        return arch

    def _validate(self) -> None:
        needs_indexer = self.model_type == "deepseek_v32" or CSA in self.layer_kinds
        indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if needs_indexer and not all(indexer):
            raise InputError(
                f"config.json of {self.name}: index_n_heads, index_head_dim and index_topk must "
                f"be > 0 for {self.model_type} (got {indexer})"
            )
        for key in ("hidden", "vocab", "num_heads", "q_lora_rank", "experts_per_token"):
            if getattr(self, key) < 1:
                raise InputError(
                    f"config.json of {self.name}: {key}={getattr(self, key)} must be >= 1"
                )
        if self.model_type == "deepseek_v4":
            if not 0 < self.qk_rope_head_dim <= self.head_dim:
                raise InputError(
                    f"config.json of {self.name}: qk_rope_head_dim={self.qk_rope_head_dim} must be "
                    f"in 1..head_dim={self.head_dim}"
                )
            if self.o_groups < 1 or self.num_heads % self.o_groups:
                raise InputError(
                    f"config.json of {self.name}: o_groups={self.o_groups} must divide "
                    f"num_attention_heads={self.num_heads}"
                )

    # ---- shape ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def v4(self) -> bool:
        """True for DeepSeek-V4's hybrid attention (window + compressed entries)."""
        return self.model_type == "deepseek_v4"

    def layer_counts(self) -> dict[str, int]:
        """Layers of each kind, ``{kind: count}`` (Flash: 2 sliding, 21 CSA, 20 HCA)."""
        counts: dict[str, int] = {}
        for kind in self.layer_kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def attended_entries(self, layer: int, context: int) -> tuple[int, int]:
        """``(window, compressed)`` entries the query at ``context`` tokens (itself included)
        attends to in ``layer``: MLA: ``(0, context)``; sparse MLA ``(0, min(context,
        index_topk))``; V4: ``min(context, sliding_window)`` window entries and the complete
        compressed windows, ``context // ratio`` (HCA), at most ``index_topk`` of them (CSA)."""
        kind, ratio = self.layer_kinds[layer], self.compress_ratios[layer]
        if kind == MLA:
            return 0, context
        if kind == SPARSE_MLA:
            return 0, min(context, self.index_topk)
        window = min(context, self.sliding_window)
        if kind == SLIDING:
            return window, 0
        entries = context // ratio
        return window, min(entries, self.index_topk) if kind == CSA else entries

    # ---- parameters ----------------------------------------------------------------------------

    def _layer_params(self, layer: int) -> dict[str, int]:
        """Parameters of ``layer`` by part (see :class:`Params`)."""
        d, kind = self.hidden, self.layer_kinds[layer]
        out: dict[str, int] = {}
        if self.v4:
            h, c, g, r = self.num_heads, self.head_dim, self.o_groups, self.o_lora_rank
            # wq_a, wq_b, wkv, wo_a (g groups of h*c/g -> r), wo_b
            out["attention"] = d * self.q_lora_rank + self.q_lora_rank * h * c + d * c
            out["attention"] += h * c * r + g * r * d
            norms = self.q_lora_rank + c + h  # q_norm, kv_norm, attention sinks
            ratio = self.compress_ratios[layer]
            if ratio:
                coff = 2 if kind == CSA else 1  # CSA pools two overlapping windows
                out["compressor"] = 2 * d * coff * c + ratio * coff * c + c  # wkv, wgate, ape, norm
            if kind == CSA:
                ih, ic = self.index_n_heads, self.index_head_dim
                out["indexer"] = self.q_lora_rank * ih * ic + d * ih  # wq_b, weights_proj
                out["indexer"] += 2 * d * 2 * ic + ratio * 2 * ic + ic  # its compressor
            hc = self.hc_mult
            mixes = (2 + hc) * hc
            norms += 2 * d + 2 * (mixes * hc * d + mixes + 3)  # attn/ffn norms, two mHC modules
            out["norms_and_mhc"] = norms
        else:
            h, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
            v = self.v_head_dim
            out["attention"] = d * self.q_lora_rank + self.q_lora_rank * h * (nope + rope)
            out["attention"] += d * (self.kv_lora_rank + rope)
            out["attention"] += self.kv_lora_rank * h * (nope + v) + h * v * d
            if kind == SPARSE_MLA:
                ih, ic = self.index_n_heads, self.index_head_dim
                out["indexer"] = self.q_lora_rank * ih * ic + d * ic + d * ih  # wq_b, wk, weights
            out["norms_and_mhc"] = self.q_lora_rank + self.kv_lora_rank + 2 * d
            if kind == SPARSE_MLA:
                out["norms_and_mhc"] += 2 * self.index_head_dim  # the indexer's k_norm
        if layer < self.num_dense_layers:
            out["dense_mlp"] = 3 * d * self.dense_intermediate
        else:
            expert = 3 * d * self.moe_intermediate
            hashed = self.v4 and layer < self.num_hash_layers
            out["router"] = self.num_routed_experts * d + (0 if hashed else self.num_routed_experts)
            out["routed_experts"] = self.num_routed_experts * expert
            out["shared_experts"] = self.num_shared_experts * expert
        return out

    def params(self) -> Params:
        """Parameters of the main model (:class:`Params`)."""
        parts: dict[str, int] = {
            "embedding": self.vocab * self.hidden,
            "head": self.vocab * self.hidden,
        }
        final = self.hidden  # the final norm
        if self.v4:  # the head's hyper-connection: hc_head_fn, base, scale
            final += self.hc_mult * self.hc_mult * self.hidden + self.hc_mult + 1
        parts["norms_and_mhc"] = final
        inactive = 0
        for layer in range(self.num_layers):
            for part, count in self._layer_params(layer).items():
                parts[part] = parts.get(part, 0) + count
            if layer >= self.num_dense_layers:
                idle = self.num_routed_experts - self.experts_per_token
                inactive += idle * 3 * self.hidden * self.moe_intermediate
        total = sum(parts.values())
        return Params(total=total, activated=total - parts["embedding"] - inactive, parts=parts)

    # ---- KV cache ------------------------------------------------------------------------------

    def entry_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of one cached entry of one layer (MLA: a token's latent; V4: a window or
        compressed entry), index key not included."""
        if self.v4:
            return v4_entry_bytes(self.head_dim, self.qk_rope_head_dim, dtype)
        sparse = self.model_type == "deepseek_v32"
        return mla_latent_bytes(self.kv_lora_rank, self.qk_rope_head_dim, dtype, sparse)

    def index_key_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of one cached index key (0 without an indexer); FP4 for V4 in ``fp8``."""
        if not self.index_head_dim:
            return 0
        return index_key_bytes(self.index_head_dim, dtype, fp4=self.v4)

    def kv_bytes(self, context: int, dtype: str = "bf16") -> int:
        """KV-cache bytes of one request holding ``context`` tokens, over all layers: MLA
        ``context`` entries per layer (and as many index keys, V3.2); V4 per layer
        ``min(context, sliding_window)`` window entries, ``context // ratio`` compressed entries
        and (CSA) as many index keys. V4's compressor state is apart
        (:attr:`compressor_state_bytes`)."""
        if context < 0:
            raise InputError(f"context={context} must be >= 0")
        entry, key = self.entry_bytes(dtype), self.index_key_bytes(dtype)
        if not self.v4:
            keys = key if self.model_type == "deepseek_v32" else 0
            return self.num_layers * context * (entry + keys)
        total = 0
        for kind, ratio in zip(self.layer_kinds, self.compress_ratios, strict=True):
            total += min(context, self.sliding_window) * entry
            if ratio:
                entries = context // ratio
                total += entries * (entry + (key if kind == CSA else 0))
        return total

    def kv_bytes_per_token(self, context: int, dtype: str = "bf16") -> float:
        """:meth:`kv_bytes` over ``context`` tokens: a constant for MLA (V3: 70,272 in BF16, V3.2:
        85,888 in BF16 and 48,068 in FP8); for V4 it falls with the context towards the
        compressed entries' share (the window is bounded)."""
        if context < 1:
            raise InputError(f"context={context} must be >= 1")
        return self.kv_bytes(context, dtype) / context

    @property
    def compressor_state_bytes(self) -> int:
        """Bytes a V4 request holds besides its KV entries (0 for MLA): each compressor's
        not-yet-closed window of projected values and gate scores in float32, ``coff x ratio``
        tokens of ``coff x dim`` each (``coff`` 2 for CSA's overlapping windows, 1 for HCA), as
        DeepSeek's inference code (``kv_state``, ``score_state``) and vLLM keep it: 64 KiB + 16
        KiB (its indexer) per CSA layer, 512 KiB per HCA layer."""
        if not self.v4:
            return 0
        total = 0
        for kind, ratio in zip(self.layer_kinds, self.compress_ratios, strict=True):
            if ratio:
                coff = 2 if kind == CSA else 1
                total += 2 * coff * ratio * coff * self.head_dim * 4
                if kind == CSA:
                    total += 2 * coff * ratio * coff * self.index_head_dim * 4
        return total

    # ---- FLOPs ---------------------------------------------------------------------------------

    def decode_flops(self, context: int) -> Flops:
        """FLOPs of the token decoded at ``context`` tokens (itself included), a multiply-add
        counted as 2, each weight GEMM at 2 x its weights, by part and by the precision the
        multiply runs in as DeepSeek's inference code and checkpoints have it (FP8 weight GEMMs;
        BF16: core attention over an FP8 or BF16 cache, MLA's absorbed up-projections, the
        router, the LM head, V4's compressor projections and indexer weights; FP4 x FP8: V4's
        routed experts; FP4: V4's indexer QK; TF32: V4's mHC projections). Norms, RoPE, softmax,
        top-k and the embedding lookup are not counted; neither are the MTP layers."""
        if context < 1:
            raise InputError(f"context={context} must be >= 1")
        terms: dict[tuple[str, str], float] = {}

        def add(part: str, precision: str, flops: float) -> None:
            terms[(part, precision)] = terms.get((part, precision), 0.0) + flops

        d = self.hidden
        for layer, kind in enumerate(self.layer_kinds):
            window, compressed = self.attended_entries(layer, context)
            if self.v4:
                h, c, r = self.num_heads, self.head_dim, self.o_lora_rank
                add("projections", "fp8", 2 * (d * self.q_lora_rank + self.q_lora_rank * h * c))
                add("projections", "fp8", 2 * (d * c + h * c * r + self.o_groups * r * d))
                ratio = self.compress_ratios[layer]
                if ratio:
                    coff = 2 if kind == CSA else 1
                    add("compressor", "bf16", 2 * 2 * d * coff * c)
                if kind == CSA:
                    ih, ic = self.index_n_heads, self.index_head_dim
                    add("projections", "fp8", 2 * self.q_lora_rank * ih * ic)  # its wq_b
                    add("projections", "bf16", 2 * d * ih)  # its weights_proj
                    add("compressor", "bf16", 2 * 2 * d * 2 * ic)  # its compressor
                    add("indexer", "fp4", 2 * ih * ic * (context // ratio))
                # shared-KV MQA: per head and entry 2c for QK, 2c for PV
                add("attention", "bf16", 4 * h * c * (window + compressed))
                mixes = (2 + self.hc_mult) * self.hc_mult
                add("mhc", "tf32", 2 * 2 * mixes * self.hc_mult * d)
            else:
                h, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
                lat, v = self.kv_lora_rank, self.v_head_dim
                q_proj = d * self.q_lora_rank + self.q_lora_rank * h * (nope + rope)
                add("projections", "fp8", 2 * q_proj)
                add("projections", "fp8", 2 * (d * (lat + rope) + h * v * d))
                # absorbed: q_nope x W_UK and the latent output x W_UV, BF16 einsums in DeepSeek's code
                add("projections", "bf16", 2 * h * lat * (nope + v))
                add("attention", "bf16", 2 * h * ((lat + rope) + lat) * compressed)
                if kind == SPARSE_MLA:
                    ih, ic = self.index_n_heads, self.index_head_dim
                    add("projections", "fp8", 2 * (self.q_lora_rank * ih * ic + d * ic))
                    add("projections", "bf16", 2 * d * ih)
                    add("indexer", "fp8", 2 * ih * ic * context)
            if layer < self.num_dense_layers:
                add("dense_mlp", "fp8", 2 * 3 * d * self.dense_intermediate)
            else:
                expert = 2 * 3 * d * self.moe_intermediate
                add("moe", "bf16", 2 * d * self.num_routed_experts)
                add("moe", "fp8", self.num_shared_experts * expert)
                add("moe", "fp4xfp8" if self.v4 else "fp8", self.experts_per_token * expert)
        if self.v4:
            add("mhc", "tf32", 2 * self.hc_mult * self.hc_mult * d)
        add("head", "bf16", 2 * d * self.vocab)
        return Flops(terms)
