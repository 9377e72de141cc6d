#!/usr/bin/env bash
# The engine in bfloat16 as on an x86 CPU with AVX2 and no AVX-512 (AMD Zen 2/3, Intel before
# Skylake-SP), on any machine: valgrind's virtual CPU has AVX2 and no AVX-512, so torch reports
# `AVX2` there and oneDNN has no bfloat16 path (its packed GEMM refuses: "bf16 path needs the cpu
# support avx_ne_convert or avx512bw, avx512vl and avx512dq"). moeinfra's fused kernels are built
# for AVX2 (x86-64-v3) into a cache of their own, as such a machine would build them.
# Run: tools/avx2_check.sh (after `make test` has made .venv; ~5 minutes, one core). Prints what
# the CPU has and the greedy tokens of the built-in tiny checkpoint in bfloat16 and in float32.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not found (Debian: apt-get install valgrind)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
printf '#!/bin/sh\nexec g++ "$@" -march=x86-64-v3\n' >"$work/cxx-avx2"
chmod +x "$work/cxx-avx2"
.venv/bin/python -c "from moeinfra.engine.tiny import default_model; default_model()"  # written natively
CXX="$work/cxx-avx2" MOEINFRA_CACHE="$work/cache" OMP_NUM_THREADS=1 \
  valgrind --tool=none -q .venv/bin/python - <<'EOF'
import warnings

import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.moe import cpu_features, cpu_kernels

features = cpu_features.detect()
print("CPU:", features.describe())
assert not features.avx512 and not features.onednn_bf16, "valgrind's CPU has no AVX-512"
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
tokens = {}
for dtype in ("bfloat16", "float32"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(dtype=dtype, num_kv_blocks=16)
    notes = [str(w.message) for w in caught if "oneDNN" in str(w.message)]
    out = llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    tokens[dtype] = [o.outputs[0].token_ids for o in out]
    print(dtype, tokens[dtype], "warned:", bool(notes))
print("fused kernels loaded:", cpu_kernels.available())
print("torch:", torch.__version__, "vector level:", torch.backends.cpu.get_cpu_capability())
EOF
