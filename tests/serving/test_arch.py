"""The arithmetic of DeepSeek-V3, V3.2, V4-Flash and V4-Pro from their published configs: parameters
against the model cards, KV bytes against hand counts and the published V3.2 figures, and the
V4 model card's 1M-token ratios to V3.2 (docs/serving-model.md, "Architectures")."""

import subprocess
import sys

import pytest

from moeinfra.errors import InputError
from moeinfra.serving import arch
from moeinfra.serving.arch import (
    CSA,
    FP8_EQUIVALENT,
    HCA,
    PUBLISHED_PARAMS,
    SLIDING,
    Architecture,
    published,
    published_config,
)
from moeinfra.serving.specs import DEEPSEEK_V3, DEEPSEEK_V32, model

V3, V32 = published("deepseek-v3"), published("deepseek-v3.2")
FLASH, PRO = published("deepseek-v4-flash"), published("deepseek-v4-pro")
MILLION = 1 << 20  # V4's 1M context: max_position_embeddings = 1,048,576

#: DeepSeek-V4 model card: at 1M tokens, (FLOPs, KV cache) as a share of DeepSeek-V3.2's
CARD = {"deepseek-v4-pro": (0.27, 0.10), "deepseek-v4-flash": (0.10, 0.07)}


@pytest.mark.parametrize("name", sorted(CARD))
def test_v4_against_v32_at_1m_tokens_as_the_model_card_states(name):
    """Single-token FLOPs in equivalent FP8 FLOPs (FP8 x1, FP4 x FP8 x1, FP4 x0.5, BF16 x2, TF32 x4)
    and KV cache in each model's low-precision format, within 15% of the card's shares. Counted as
    decided from DeepSeek's code, checkpoints and report, not fitted: at 1,048,576 tokens Pro
    26.7% and 10.5%, Flash 10.1% and 7.3% (at 1,000,000: Pro 27.1%, Flash 10.2% of the FLOPs)."""
    v4 = published(name)
    flops = v4.decode_flops(MILLION).equivalent_fp8 / V32.decode_flops(MILLION).equivalent_fp8
    kv = v4.kv_bytes(MILLION, "fp8") / V32.kv_bytes(MILLION, "fp8")
    card_flops, card_kv = CARD[name]
    assert flops == pytest.approx(card_flops, rel=0.15)
    assert kv == pytest.approx(card_kv, rel=0.15)
    # within 2% the same at 1,000,000 tokens; and the KV share holds with both caches in BF16
    assert v4.decode_flops(10**6).equivalent_fp8 / V32.decode_flops(10**6).equivalent_fp8 == (
        pytest.approx(flops, rel=0.02)
    )
    assert v4.kv_bytes(MILLION) / V32.kv_bytes(MILLION) == pytest.approx(card_kv, rel=0.15)


def test_the_ratios_rest_on_what_v4_changes_not_on_the_weighting():
    """Counted FLOPs without any precision weighting still land near the card (Pro 26%, Flash
    12%): the indexer over a quarter of the tokens in FP4 and HCA's 1/128 are what move them."""
    for name, (card, _) in CARD.items():
        raw = published(name).decode_flops(MILLION).total / V32.decode_flops(MILLION).total
        assert raw == pytest.approx(card, rel=0.25)
    # at 1M tokens V3.2's indexer is most of its work; V4-Pro's is a sixth of V3.2's in FP8 units
    v32_parts, pro_parts = V32.decode_flops(MILLION).by_part(), PRO.decode_flops(MILLION).by_part()
    assert v32_parts["indexer"] / sum(v32_parts.values()) > 0.85
    assert pro_parts["indexer"] < v32_parts["indexer"] / 15


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameters_round_to_the_published_figures(name):
    """Total and activated parameters of the main model (MTP layers left out; activated without
    the embedding table) equal the published figure at its own precision: V3 671B / 37B (the
    README's 36.6B with the head), V4-Flash 284B / 13B, V4-Pro 1.6T / 49B."""
    params = published(name).params()
    total, activated = PUBLISHED_PARAMS[name]
    for counted, stated in ((params.total, total), (params.activated, activated)):
        digits = len(f"{stated:e}".split("e")[0].replace(".", "").rstrip("0"))  # 671e9: 3
        assert float(f"{counted:.{digits}g}") == stated, (name, counted, stated)
    assert params.total == sum(params.parts.values())


def test_parameters_from_the_checkpoint_tensor_shapes():
    """Per layer, V4-Pro's attention weights as DeepSeek's checkpoint lists them: wq_a 1,536 x
    7,168, wq_b 65,536 x 1,536, wkv 512 x 7,168, wo_a 16,384 x 4,096, wo_b 7,168 x 16,384; a CSA
    layer's compressor 2 x 1,024 x 7,168 (+ ape 4 x 1,024, norm 512), its indexer wq_b 8,192 x
    1,536, weights_proj 64 x 7,168 and compressor 2 x 256 x 7,168 (+ ape 4 x 256, norm 128)."""
    layer = PRO._layer_params(2)  # layer 2 is CSA
    assert PRO.layer_kinds[2] == CSA and PRO.layer_kinds[1] == HCA
    assert layer["attention"] == (
        1536 * 7168 + 65536 * 1536 + 512 * 7168 + 16384 * 4096 + 7168 * 16384
    )
    assert layer["compressor"] == 2 * 1024 * 7168 + 4 * 1024 + 512
    assert layer["indexer"] == 8192 * 1536 + 64 * 7168 + 2 * 256 * 7168 + 4 * 256 + 128
    assert PRO._layer_params(1)["compressor"] == 2 * 512 * 7168 + 128 * 512 + 512  # HCA
    # 384 experts of gate/up/down 3,072 x 7,168 per layer, and the router (bias from layer 3 on)
    assert layer["routed_experts"] == 384 * 3 * 3072 * 7168
    assert (layer["router"], PRO._layer_params(3)["router"]) == (384 * 7168, 384 * 7168 + 384)


def test_the_serving_model_spec_is_the_same_arithmetic():
    """ModelSpec's KV bytes come from this module's entry formats, and its activated parameters
    are this count without the routers and norms it leaves out."""
    for spec, arc in ((DEEPSEEK_V3, V3), (DEEPSEEK_V32, V32)):
        for dtype in ("bf16", "fp8"):
            assert model(spec.name, dtype).kv_bytes_per_token == arc.kv_bytes_per_token(1, dtype)
        params = arc.params()
        left_out = params.parts["router"] + params.parts["norms_and_mhc"]
        assert spec.activated_params == params.activated - left_out


def test_mla_kv_bytes_as_published():
    """V3: (512 + 64) x 2 x 61 = 70,272 B per token in BF16; V3.2 adds a 128-value index key:
    85,888 B in BF16, 48,068 B in FP8 (656 + 132 per layer); constant in the context."""
    assert V3.kv_bytes_per_token(1) == 70_272 and V3.kv_bytes_per_token(MILLION) == 70_272
    assert V3.kv_bytes_per_token(7, "fp8") == 576 * 61
    assert V32.kv_bytes(1000) == 85_888 * 1000
    assert V32.kv_bytes_per_token(4096, "fp8") == (656 + 132) * 61 == 48_068
    assert V3.compressor_state_bytes == V32.compressor_state_bytes == 0


def test_v4_entry_formats_by_hand():
    """A V4 entry: 448 FP8 + 7 UE8M0 scales padded to 8 + 64 BF16 RoPE values = 584 B (1,024 in
    BF16); an index key: 128 FP4 values in 64 B + 4 UE8M0 scales = 68 B (256 in BF16)."""
    for v4 in (FLASH, PRO):
        assert v4.entry_bytes("fp8") == 448 + 8 + 128 == 584
        assert v4.entry_bytes("bf16") == 1024
        assert v4.index_key_bytes("fp8") == 64 + 4 == 68
        assert v4.index_key_bytes("bf16") == 256


def test_v4_kv_bytes_at_small_contexts_by_hand():
    """Flash (2 sliding, 21 CSA, 20 HCA layers; window 128): every layer keeps the last 128
    tokens, CSA one entry + index key per 4 tokens, HCA one entry per 128 tokens."""
    assert FLASH.layer_counts() == {SLIDING: 2, CSA: 21, HCA: 20}
    assert PRO.layer_counts() == {HCA: 31, CSA: 30}
    e, k = 584, 68
    assert FLASH.kv_bytes(1, "fp8") == 43 * e  # one window entry per layer
    assert FLASH.kv_bytes(3, "fp8") == 43 * 3 * e  # no window of 4 closed yet
    assert FLASH.kv_bytes(4, "fp8") == 43 * 4 * e + 21 * (e + k)
    assert FLASH.kv_bytes(200, "fp8") == 43 * 128 * e + 21 * 50 * (e + k) + 20 * 1 * e
    assert FLASH.kv_bytes(200) == 43 * 128 * 1024 + 21 * 50 * (1024 + 256) + 20 * 1024
    assert PRO.kv_bytes(1000, "fp8") == 61 * 128 * e + 30 * 250 * (e + k) + 31 * 7 * e
    # beyond the window the bytes per token fall towards the compressed entries alone:
    # Flash 21/4 x 652 + 20/128 x 584 = 3,514.25 B (as DeepSeek's V4.1 report draws V4-Flash)
    compressed = 21 / 4 * (e + k) + 20 / 128 * e
    assert compressed == 3514.25
    assert FLASH.kv_bytes_per_token(MILLION, "fp8") == pytest.approx(compressed, rel=0.002)
    # the compressors' open windows, in float32: 64 + 16 KiB per CSA layer, 512 KiB per HCA layer
    assert FLASH.compressor_state_bytes == 21 * (64 + 16) * 1024 + 20 * 512 * 1024


def test_v4_attention_and_indexer_flops_by_hand():
    """Decode at 2,048 tokens in V4-Pro: a CSA layer attends to 128 window + 512 compressed entries
    (fewer than index_topk = 1,024) and scores 512 with the indexer; an HCA layer 128 + 16."""
    assert PRO.attended_entries(2, 2048) == (128, 512)
    assert PRO.attended_entries(1, 2048) == (128, 16)
    assert PRO.attended_entries(2, MILLION) == (128, 1024)
    terms = PRO.decode_flops(2048).terms
    per_entry = 4 * 128 * 512  # QK and PV over 512 dims, 128 heads
    assert terms[("attention", "bf16")] == per_entry * (30 * 640 + 31 * 144)
    assert terms[("indexer", "fp4")] == 30 * 2 * 64 * 128 * 512
    # the routed experts: 6 of gate/up/down 3,072 x 7,168 per layer, FP4 weights x FP8 activations
    assert terms[("moe", "fp4xfp8")] == 61 * 6 * 2 * 3 * 7168 * 3072
    # V3 attends to all 2,048 latents: QK over 576, PV over 512, 128 heads, 61 layers
    v3 = V3.decode_flops(2048).terms
    assert v3[("attention", "bf16")] == 61 * 2 * 128 * (576 + 512) * 2048
    assert V32.decode_flops(2048).terms[("attention", "bf16")] == v3[("attention", "bf16")]
    assert V32.decode_flops(4096).terms[("attention", "bf16")] == v3[("attention", "bf16")]


def test_equivalent_fp8_weights():
    f = arch.Flops({("a", "bf16"): 1.0, ("b", "fp8"): 2.0, ("c", "fp4"): 4.0, ("d", "tf32"): 1.0})
    assert f.total == 8.0 and f.equivalent_fp8 == 2.0 + 2.0 + 2.0 + 4.0
    assert f.by_part(fp8_equivalent=False) == {"a": 1.0, "b": 2.0, "c": 4.0, "d": 1.0}
    assert set(FP8_EQUIVALENT) == {"fp8", "fp4xfp8", "fp4", "bf16", "tf32"}


def test_layer_schedule_from_either_spelling():
    """DeepSeek's compress_ratios (one per layer, then the MTP layer's) and transformers'
    layer_types give the same architecture."""
    raw = published_config("deepseek-v4-flash")
    assert len(raw["compress_ratios"]) == 44  # 43 layers + MTP
    kinds = {0: SLIDING, 4: CSA, 128: HCA}
    spelled = {k: v for k, v in raw.items() if k != "compress_ratios"}
    spelled["layer_types"] = [kinds[r] for r in raw["compress_ratios"][:43]]
    assert Architecture.from_config(spelled, "deepseek-v4-flash") == FLASH
    # DeepSeek's checkpoint: indexers on layers 2, 4, ..., 42; ratio-128 compressors on 3, ..., 41
    assert [i for i, k in enumerate(FLASH.layer_kinds) if k == CSA] == list(range(2, 43, 2))
    assert [i for i, k in enumerate(FLASH.layer_kinds) if k == HCA] == list(range(3, 42, 2))


def test_bad_configs_are_refused_naming_the_key():
    raw = published_config("deepseek-v4-pro")
    with pytest.raises(InputError, match=r"'compress_ratios' \(or 'layer_types'\) is missing"):
        Architecture.from_config({k: v for k, v in raw.items() if k != "compress_ratios"}, "x")
    with pytest.raises(InputError, match=r"compress_ratios values \[8\]"):
        Architecture.from_config({**raw, "compress_ratios": [8] * 62}, "x")
    with pytest.raises(InputError, match=r"model_type='llama' is not one of"):
        Architecture.from_config({**raw, "model_type": "llama"}, "x")
    with pytest.raises(InputError, match=r"index_topk must be > 0"):
        Architecture.from_config({**raw, "index_topk": 0}, "x")
    with pytest.raises(InputError, match=r"required key 'hidden_size' is missing"):
        Architecture.from_config({k: v for k, v in raw.items() if k != "hidden_size"}, "x")
    with pytest.raises(InputError, match=r"model='deepseek-v5' is not one of deepseek-v3, "):
        published("deepseek-v5")
    with pytest.raises(InputError, match=r"context=0 must be >= 1"):
        FLASH.kv_bytes_per_token(0)


def test_no_torch_and_no_engine():
    """The architecture arithmetic is torch-free and reads the engine's data files only."""
    code = (
        "import sys; from moeinfra.serving.arch import published; "
        "published('deepseek-v4-pro').decode_flops(1 << 20); "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('moeinfra.engine')]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
