#!/usr/bin/env bash
# The GPU check of issue #35, in one call on a machine with an NVIDIA GPU (run from the repository
# root; under 8 minutes on an H100/H200): installs what the machine's image lacks from .whl/
# (tools/device_wheels.sh fetches them beforehand: the machine has no network), then
#   1. the engine's CUDA tests (tests/engine/test_cuda.py: greedy = transformers on the card in
#      float32, bf16 within the stated tolerance, FP8 weights kept in FP8, a server unit on CUDA);
#   2. benchmarks/bench_gpu.py: a ~1.2B-parameter DeepSeek-V3-shaped checkpoint, moeinfra against
#      transformers (and vLLM's GPU build if installed) on the same card, bf16 and FP8.
# Results go to $OUT (default build/device-check): versions.txt, cuda-tests.log, bench_gpu.json.
set -u
OUT=${OUT:-build/device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
started=$SECONDS
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/moeinfra-site .whl/*.whl && export PYTHONPATH=/tmp/moeinfra-site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PY
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
timeout 270 python3 -m pytest tests/engine/test_cuda.py -p no:cacheprovider -q -rs -s \
  --timeout 240 --junitxml "$OUT/cuda-tests.xml" > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: exit $? after $((SECONDS - started)) s"
tail -n 25 "$OUT/cuda-tests.log"
left=$((${CHECK_BUDGET_S:-440} - (SECONDS - started)))
timeout $((left > 60 ? left : 60)) python3 -m benchmarks.bench_gpu --out "$OUT/bench_gpu.json" \
  --budget-s $((left > 90 ? left - 90 : 30)) > "$OUT/bench_gpu.log" 2>&1
echo "bench: exit $? after $((SECONDS - started)) s"
grep -v '^ \|^{\|^}' "$OUT/bench_gpu.log" | tail -n 20
echo "device check done in $((SECONDS - started)) s"
