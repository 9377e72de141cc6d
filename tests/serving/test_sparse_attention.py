"""DeepSeek-V3.2 in the serving model: the architecture from its published config, its KV bytes,
the indexer and sparse MLA in prefill and decode, and the memory fit (docs/serving-model.md,
"DeepSeek-V3.2: what sparse attention changes")."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.calibration import load_calibration
from moeinfra.serving.perfmodel import INDEXER, PARTS, MemoryUse, PerfModel
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    MODELS,
    ModelSpec,
    deepseek_decode_unit,
    deepseek_prefill_unit,
    hardware,
    model,
    published_config,
)

H800 = hardware("h800")


@pytest.fixture(scope="module")
def units():
    """(prefill, decode) PerfModels of V3 and V3.2 on DeepSeek's units, by model name."""
    return {
        m.name: (
            PerfModel(deepseek_prefill_unit(), H800, m),
            PerfModel(deepseek_decode_unit(), H800, m),
        )
        for m in (DEEPSEEK_V3, DEEPSEEK_V32)
    }


def test_both_architectures_come_from_deepseeks_published_configs():
    assert set(MODELS) == {"deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro"}
    assert ModelSpec() == DEEPSEEK_V3  # the shape the serving model always had
    assert not DEEPSEEK_V3.sparse and DEEPSEEK_V32.sparse
    v32 = DEEPSEEK_V32
    assert (v32.index_n_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048)
    # V3.2 is V3 plus the indexer: every other dimension is the same
    assert replace(v32, name="deepseek-v3", index_n_heads=0, index_head_dim=0, index_topk=0) == (
        DEEPSEEK_V3
    )
    assert published_config("deepseek-v3.2-exp")["model_type"] == "deepseek_v32"
    # the indexer: wq_b 1536 -> 64 x 128, wk 7168 -> 128, weights_proj 7168 -> 64
    assert v32.indexer_params == 1536 * 8192 + 7168 * 128 + 7168 * 64 == 13_959_168
    assert v32.activated_params - DEEPSEEK_V3.activated_params == 61 * 13_959_168


def test_kv_bytes_per_token_as_published():
    """REFERENCE.md: (512 + 64 + 128) x 2 x 61 = 85,888 B in BF16 (V3: 70,272); vLLM/SGLang's FP8:
    656-byte fp8_ds_mla latent + 132-byte index key, 788 x 61 = 48,068 B."""
    assert DEEPSEEK_V3.kv_bytes_per_token == 70_272
    assert DEEPSEEK_V32.kv_bytes_per_token == 85_888
    fp8 = model("deepseek-v3.2", "fp8")
    assert fp8.latent_bytes_per_token_layer == 656 and fp8.index_key_bytes_per_token_layer == 132
    assert fp8.kv_bytes_per_token == 48_068
    assert model("deepseek-v3", "fp8").kv_bytes_per_token == 576 * 61


def test_bad_models_are_refused_naming_what_is_allowed():
    with pytest.raises(InputError, match=r"model='deepseek-v5' is not one of deepseek-v3, "):
        model("deepseek-v5")
    with pytest.raises(InputError, match=r"kv_cache_dtype='fp4' is not one of bf16, fp8"):
        model("deepseek-v3.2", "fp4")
    with pytest.raises(InputError, match="all > 0 .sparse attention. or all 0"):
        ModelSpec(index_topk=2048)
    with pytest.raises(InputError, match="missing or bad key"):
        ModelSpec.from_config({"hidden_size": 8}, "m")


def test_reading_the_configs_imports_neither_torch_nor_the_engine():
    code = (
        "import sys, moeinfra.serving, moeinfra.serving.position_cost, moeinfra.cli.serve; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('moeinfra.engine')]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_dense_model_has_no_indexer_part(units):
    prefill, decode = units["deepseek-v3"]
    for b in (prefill.prefill_breakdown(), decode.decode_breakdown(64.0, 4096.0)):
        assert tuple(b.parts) == PARTS
    prefill, decode = units["deepseek-v3.2"]
    for b in (prefill.prefill_breakdown(), decode.decode_breakdown(64.0, 4096.0)):
        assert INDEXER in b.parts and b.parts[INDEXER].min() > 0


def test_sparse_decode_attends_to_index_topk_keys_and_indexes_them_all(units):
    """Decode: MLA over min(KV, 2,048) keys per query (flat beyond), the indexer over every key
    (linear); at long context far below V3's dense attention."""
    decode = units["deepseek-v3.2"][1]
    kv = np.array([8_192.0, 32_768.0, 131_072.0])
    rows = [decode.decode_breakdown(64.0, k) for k in kv]
    core = np.array([b.parts["core_attn"][10] for b in rows])
    indexer = np.array([b.parts[INDEXER][10] for b in rows])
    assert core == pytest.approx(np.full(3, core[0]), rel=1e-12)
    growth = np.diff(indexer) / np.diff(kv)  # seconds per key: the same at every length
    assert growth[1] == pytest.approx(growth[0], rel=0.02)
    dense = units["deepseek-v3"][1].decode_breakdown(64.0, 131_072.0)
    assert rows[-1].step_s < 0.5 * dense.step_s
    assert decode.decode_step_s(64.0, 131_072.0) == pytest.approx(rows[-1].step_s, rel=1e-9)


def test_the_prefill_indexer_reads_each_index_key_once_per_micro_batch(index_logits_work):
    """A prefill micro-batch's logits read its index keys once, as DeepSeek-V4's do (one helper):
    an 8,192-token micro-batch ending a 131,072-token prompt (mean context 126,976) reads the
    131,072 keys of 132 bytes (FP8) once and writes a float32 logit per query and key."""
    v32 = PerfModel(deepseek_prefill_unit(), H800, model("deepseek-v3.2", "fp8"))
    seen = index_logits_work
    n, context = 8192, 131_072 - 4096
    nb = 2 * n  # two micro-batches of n tokens
    v32.prefill_breakdown(tokens_per_gpu=nb, attn_keys_per_token=context)
    flops, read = seen[-1]
    assert flops == 2 * 64 * 128 * n * context
    assert read == 131_072 * 132 + 4 * n * context


def test_sparse_prefill_masks_mha_for_short_context_and_goes_sparse_beyond(units):
    """The report: "for short-sequence prefilling, we specially implement a masked MHA mode";
    beyond ~6K keys MLA's MQA mode over 2,048 selected keys is cheaper, and it stays flat."""
    v3, v32 = units["deepseek-v3"][0], units["deepseek-v3.2"][0]

    def core(perf, keys):
        return perf.prefill_breakdown(attn_keys_per_token=keys).parts["core_attn"][10]

    # masked MHA: V3's kernel over every key; on one micro-batch (no all-to-all beside it) the
    # same seconds, on two a little less: V3.2's indexer runs first, while the other
    # micro-batch's combine holds its SMs, and leaves the attention less of it
    one = {
        name: PerfModel(deepseek_prefill_unit().with_(micro_batches=1), H800, m)
        for name, m in (("v3", DEEPSEEK_V3), ("v32", DEEPSEEK_V32))
    }
    assert core(one["v32"], 4096.0) == pytest.approx(core(one["v3"], 4096.0), rel=1e-12)
    assert 0.9 * core(v3, 4096.0) < core(v32, 4096.0) < core(v3, 4096.0)
    assert core(v32, 16_384.0) < core(v3, 16_384.0)
    # flat beyond: the same FLOPs at every length (on two micro-batches the longer indexer
    # leaves the attention less of the combine's window)
    assert core(one["v32"], 131_072.0) == pytest.approx(core(one["v32"], 16_384.0), rel=1e-12)
    assert core(v32, 131_072.0) == pytest.approx(core(v32, 16_384.0), rel=0.05)
    weight = v32.prefill_attention_weight(np.array([1e3, 4e3, 16e3, 64e3, 128e3]))
    assert (np.diff(weight) > 0).all()  # the indexer keeps growing with the keys


def test_memory_fit_and_kv_capacity_follow_the_cache_format(units):
    v3, v32 = units["deepseek-v3"][1], units["deepseek-v3.2"][1]
    fp8 = PerfModel(deepseek_decode_unit(), H800, model("deepseek-v3.2", "fp8"))
    use: MemoryUse = v32.memory_use()
    assert use.kv_one_request == 131_072 * 85_888
    assert use.weights == pytest.approx(v3.memory_use().weights + 61 * 13_959_168)
    free = 80e9 * 0.9 - v32.weight_bytes_per_gpu
    assert v32.kv_capacity_tokens_per_gpu == pytest.approx(free / 85_888)
    assert (
        v32.kv_capacity_tokens_per_gpu
        < v3.kv_capacity_tokens_per_gpu
        < fp8.kv_capacity_tokens_per_gpu
    )


def test_a_deepseek_v3_calibration_carries_to_v32_but_not_to_another_shape():
    cal = load_calibration("deepseek-h800")
    on_v32 = cal.with_model(DEEPSEEK_V32)
    assert on_v32.model == DEEPSEEK_V32 and on_v32.factors == cal.factors
    with pytest.raises(InputError, match=r"differs from it in hidden, num_heads"):
        cal.with_model(replace(DEEPSEEK_V3, name="small", hidden=1024, num_heads=16))
