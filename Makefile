# Every target sets itself up: it (re)creates .venv when missing or when pyproject.toml changed.
PY := python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint docs mutate setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# the Mooncake KV connector's import needs libibverbs.so.1 (also over TCP): installed where
	@# this user may, else its tests are skipped
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } >/dev/null 2>&1; } \
	  || echo "note: no libibverbs.so.1 (apt-get install libibverbs1): the Mooncake connector's tests will be skipped"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/moeinfra demo --out report

# Two workers (CI has 2 cores); a test module stays on one worker, so its fixtures start once.
# Tests that compare live timings run afterwards with the machine to themselves.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope -m "not alone"
	$(BIN)/python -m pytest -m alone

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Mutation testing (docs/testing.md): not part of make test or CI; ~40 min on 2 cores.
mutate: $(STAMP)
	test -x $(BIN)/mutmut || $(BIN)/python -m pip install --quiet -e '.[dev,mutate]'
	$(BIN)/python tools/mutate.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples tools
	$(BIN)/ruff format --check src tests benchmarks examples tools

clean:
	rm -rf $(VENV) report site
