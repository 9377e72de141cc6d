"""Classification rules: DeepEP namespaces (anchored), NCCL/RCCL/HCCL, p2p memcpy, user rules."""

from __future__ import annotations

import pytest

from moeinfra.errors import InputError
from moeinfra.trace.classify import COMM, COMPUTE, MEMORY, Classifier, Rule, comm_rules, op_key
from moeinfra.trace.model import KERNEL, MEMCPY, MEMSET

CLS = Classifier()


@pytest.mark.parametrize(
    "name",
    [
        "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*)",
        "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*)",
        "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, long*)",
        "void dpsk::ep::internode::cached_notify<false>(int, int)",
        "void deep_ep::intranode::notify_dispatch<8>(int const*)",
        "void deep_ep::intranode::cached_notify_combine<8>(void**)",
        "void deep_ep::internode_ll::dispatch<false, 3, 7168>(void*)",
        "void deep_ep::internode_ll::combine<3, 7168, 9>(void*)",
        "void deep_ep::internode_ll::clean_low_latency_buffer<32>(int*, int)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
        "rcclKernel_AllReduce(void)",
        "HcclAllReduce",
        "Memcpy PtoP (Device -> Device)",
        "void vllm::cross_device_reduce_1stage<float, 8>(vllm::RankData*)",
    ],
)
def test_communication_kernels(name):
    kind = MEMCPY if name.startswith("Memcpy") else KERNEL
    assert CLS.classify_name(name, kind) == COMM


@pytest.mark.parametrize(
    "name",
    [
        # layout only: computes the routing layout, moves no data
        "void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*)",
        "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*)",
        # dpsk::ep:: only inside a template argument or a longer namespace
        "void cutlass::device_kernel<dpsk::ep::fused::GemmKernel>(dpsk::ep::fused::GemmKernel::Params)",
        "void xdpsk::ep::internode::dispatch<8>(int4*)",
        "void mydeep_ep::intranode::combine<8>(int4*)",
        "void dpsk::epilogue::combine_scales<8>(float*)",
        "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(Params)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64",
        "void cuda::combine_and_cast<float>(float*)",  # 'combine' outside an EP namespace
    ],
)
def test_compute_kernels(name):
    assert CLS.classify_name(name, KERNEL) == COMPUTE


def test_memory_ops_default_to_memory():
    assert CLS.classify_name("Memcpy DtoD (Device -> Device)", MEMCPY) == MEMORY
    assert CLS.classify_name("Memcpy HtoD (Pinned -> Device)", MEMCPY) == MEMORY
    assert CLS.classify_name("Memset (Device)", MEMSET) == MEMORY


def test_op_key_strips_only_the_return_type():
    assert op_key("void foo::bar<int>(int)") == "foo::bar<int>(int)"
    assert op_key("voidfoo") == "voidfoo"
    assert op_key("Memcpy PtoP (Device -> Device)") == "Memcpy PtoP (Device -> Device)"


def test_user_rules_come_first_and_are_anchored():
    cls = Classifier([*comm_rules([r"my_alltoall", r".*fused_a2a"]), *CLS.rules])
    assert cls.classify_name("void my_alltoall_kernel<8>(int)") == COMM
    assert cls.classify_name("void other::my_alltoall<8>(int)") == COMPUTE  # anchored at the start
    assert cls.classify_name("void ns::deep::fused_a2a(int)") == COMM  # '.*' for anywhere
    # a user rule can also override a default
    override = Classifier([Rule(r"ncclDevKernel_SendRecv", "compute", "mine"), *CLS.rules])
    assert override.classify_name("ncclDevKernel_SendRecv(x)") == COMPUTE
    assert override.classify_name("ncclDevKernel_AllGather(x)") == COMM


def test_bad_rules_are_rejected():
    with pytest.raises(InputError, match="pattern"):
        Rule("([", "communication", "x")
    with pytest.raises(InputError, match="op_class"):
        Rule("x", "network", "x")
