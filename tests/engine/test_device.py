"""Device placement and FP8 weights, on whatever this machine has (CI: the CPU only).

The CUDA side of the same promises is in ``test_cuda.py`` (skipped without a GPU)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from moeinfra.engine import LLM, EngineConfig, SamplingParams
from moeinfra.engine.device import collective_backend, keeps_fp8, resolve_device, resolve_dtype
from moeinfra.engine.fp8 import Fp8Linear, dequantize, fp8_kernel, quantize
from moeinfra.engine.tiny import init_tiny
from moeinfra.errors import InputError

from .conftest import MAX_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_device_dtype_and_backend_resolve_as_documented():
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert collective_backend(cpu) == "gloo"
    assert collective_backend(torch.device("cuda", 1)) == "nccl"
    assert (
        not keeps_fp8("auto", cpu) and keeps_fp8("keep", cpu) and not keeps_fp8("dequantize", cpu)
    )
    for bad, allowed in (("gpu", "auto, cpu, cuda or cuda:N"), ("cuda:x", "cuda:N")):
        with pytest.raises(InputError, match=rf"device='{bad}' is not allowed; use .*{allowed}"):
            EngineConfig(device=bad)
    with pytest.raises(InputError, match="fp8_weights='fp4' is not allowed"):
        EngineConfig(fp8_weights="fp4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where there is no GPU")
def test_auto_is_the_cpu_in_float32_and_cuda_is_refused_clearly(tiny_path):
    assert resolve_device("auto") == torch.device("cpu")
    llm = LLM(tiny_path)
    assert llm._core.device == torch.device("cpu") and llm._core.dtype == torch.float32
    assert llm._core.cache.data.device.type == "cpu"
    with pytest.raises(InputError, match="device='cuda': torch sees no CUDA GPU here"):
        LLM(tiny_path, device="cuda")


def test_fp8_linear_dequantises_exactly_what_the_loader_would():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.05
    q, scale = quantize(w)
    layer = Fp8Linear(q, scale)
    assert (
        layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    )
    x = torch.randn(5, 384, generator=g)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize(q, scale)))
    assert layer(x[None]).shape == (1, 5, 256)
    assert fp8_kernel(torch.device("cpu")) == "dequantize"
    with pytest.raises(InputError, match=r"weight_scale_inv has shape \(1, 3\).*needs \(2, 3\)"):
        Fp8Linear(q, scale[:1])


@pytest.fixture(scope="module")
def fp8_path(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("fp8") / "tiny-fp8", tokenizer="bpe", fp8=True)


def test_fp8_kept_in_fp8_generates_what_the_dequantised_checkpoint_does(fp8_path, prompt_ids):
    kept = LLM(fp8_path, fp8_weights="keep")
    model = kept._core.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    # every decoder projection the checkpoint stores in FP8: 4 MLA projections x 3 layers (wkv_b
    # is dequantised: it is only used absorbed), the dense MLP's 3, and per MoE layer the shared
    # expert's 3 and 16 routed experts' 3
    assert len(fp8) == 4 * 3 + 3 + 2 * (3 + 16 * 3)
    assert {m.weight.dtype for m in fp8} == {torch.float8_e4m3fn}
    assert model.lm_head.weight.dtype == torch.float32  # kept as DeepSeek ships it
    plain = LLM(fp8_path, fp8_weights="dequantize")
    assert not any(isinstance(m, Fp8Linear) for m in plain._core.model.modules())
    ours = [o.outputs[0].token_ids for o in kept.generate(prompt_ids, GREEDY, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_ids, GREEDY, use_tqdm=False)]
    assert ours == ref


@pytest.mark.timeout(240)
def test_fp8_experts_migrate_live_between_ranks(fp8_path, prompt_ids):
    """Live rebalancing moves FP8 expert weights and their float32 scales as bytes."""
    one = LLM(fp8_path, fp8_weights="keep")
    ref = [o.outputs[0].token_ids for o in one.generate(prompt_ids, GREEDY, use_tqdm=False)]
    options = {"redundant_experts": 2, "eplb_interval": 2, "eplb_window": 3}
    with LLM(fp8_path, ranks=2, fp8_weights="keep", timeout_s=180, **options) as llm:
        outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == ref


_MALLINFO = """
import ctypes, torch
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
def mapped_and_free_mb():
    tensor = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    mapped = mallinfo2().hblkhd
    del tensor
    return [mapped >> 20, mallinfo2().fordblks >> 20]
"""
_MALLOC_PROBE = (
    _MALLINFO
    + """
import sys
from moeinfra.memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
elif sys.argv[1] != "none":  # an engine on the CPU keeps freed memory once loaded
    from moeinfra.engine import LLM
    LLM(sys.argv[1], device="cpu")
print(*mapped_and_free_mb())
"""
)


def _launched_rank_mapped_and_free_mb() -> list[int]:
    probe: dict = {}
    exec(_MALLINFO, probe)
    return probe["mapped_and_free_mb"]()


def _glibc_version() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    if platform.system() != "Linux" or name != "glibc":
        return ()
    return tuple(int(part) for part in version.split("."))


@pytest.mark.skipif(_glibc_version() < (2, 33), reason="glibc's malloc, mallinfo2 from 2.33")
def test_a_cpu_engine_keeps_the_memory_its_tensors_free(tiny_path):
    """glibc maps a 16 MB tensor on its own and unmaps it when freed (the next one lands on fresh
    pages, a page fault per 4 KB); once a CPU engine is loaded, it comes from the heap and its
    memory stays there, free for the next tensor."""

    def mapped_and_free_mb(setting: str) -> list[int]:
        run = subprocess.run(
            [sys.executable, "-c", _MALLOC_PROBE, setting],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))},
        )
        return [int(mb) for mb in run.stdout.split()]

    mapped, _ = mapped_and_free_mb("none")
    assert mapped >= 16
    for setting in ("keep", str(tiny_path)):
        mapped, free = mapped_and_free_mb(setting)
        assert mapped < 16 and free >= 16, setting


@pytest.mark.timeout(120)
@pytest.mark.skipif(_glibc_version() < (2, 33), reason="glibc's malloc, mallinfo2 from 2.33")
@pytest.mark.skipif(
    any(k.startswith(("MALLOC_", "GLIBC_")) for k in os.environ), reason="malloc tunables set"
)
def test_launched_ranks_keep_the_memory_their_tensors_free():
    """Every rank ``moe.launch`` spawns (``moeinfra moe run``, ``train``) keeps freed memory too."""
    from moeinfra.moe.launch import launch

    [(mapped, free)] = launch(1, _launched_rank_mapped_and_free_mb, timeout_s=100)
    assert mapped < 16 and free >= 16
