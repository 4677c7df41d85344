# Two entry points for a fresh machine (Linux, Python >= 3.11, a C++ compiler, CMake >= 3.24, make):
#   make main   set up, run the CPU default sweep and regenerate the report
#   make test   set up and run the test suite
# Set-up is a virtualenv in .venv with the package installed editable (this builds kernels/cpu with
# CMake) and a Jupyter kernel named "turbo-moe" installed into the venv (so each clone has its own; the
# venv's jupyter and papermill find it first). It prints one line per stage, with the seconds so far.
#
# The CUDA library (kernels/cuda, with the CUTLASS Hopper grouped GEMM) is built only where it can be
# used: CUDA=auto (the default) builds it when `nvidia-smi -L` lists a GPU and nvcc is on PATH; CUDA=1
# builds it anyway (nvcc required), CUDA=0 never. Only then is nvidia-cutlass (headers only) fetched,
# into build/cutlass, outside the venv.
#   make setup CUDA=1   the venv's editable install with the CUDA library as well
#   make cuda           the CPU and CUDA libraries built here with CMake into build/cuda/lib (no GPU needed;
#                       an existing venv is only read, for jax's FFI headers; a missing one is set up
#                       first): carry that folder to the GPU machine and set TURBO_MOE_LIB_DIR to it there
#   make cuda-check     the same build, as a compile check of kernels/cuda (CI runs it where nvcc exists)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.turbo-moe-installed
CUDA ?= auto
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# The CPU kernels target the portable baseline, as a wheel does, and the grouped GEMM picks its
# AVX2/AVX-512 variant at run time: as fast as -march=native and bit-identical to it on an AVX2 host
# (docs/performance.md, "CPU kernels"). Passed explicitly so an older build cache's `native` is replaced;
# `make CPU_ARCH=native` still tunes everything for this machine.
CPU_ARCH ?= $(if $(filter x86_64 amd64,$(shell uname -m)),x86-64-v2,)
CUTLASS_VERSION := 4.2.0.0
CUTLASS_DIR := build/cutlass
CUTLASS_INCLUDE := $(abspath $(CUTLASS_DIR))/cutlass_library/source/include
CUDA_BUILD := build/cuda

ifeq ($(CUDA),auto)
  WITH_CUDA := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && command -v nvcc >/dev/null && echo 1 || echo 0)
else ifneq ($(filter 1 0,$(CUDA)),)
  WITH_CUDA := $(CUDA)
else
  $(error CUDA must be auto, 1 or 0, got '$(CUDA)')
endif
CUDA_DEFINES := -C cmake.define.TURBO_MOE_CUDA=$(if $(filter 1,$(WITH_CUDA)),ON -C cmake.define.TURBO_MOE_CUTLASS_INCLUDE=$(CUTLASS_INCLUDE),OFF)
PIP_BUILD := -C cmake.define.TURBO_MOE_CPU_ARCH=$(CPU_ARCH) $(CUDA_DEFINES)
# pip's progress bars only draw on a terminal; elsewhere (CI, a log) pip prints a line per package.
PIP := $(BIN)/python -m pip --disable-pip-version-check
T0 := $(shell date +%s)
stage = @echo "==> [setup $(1)] $(2) ($$(( $$(date +%s) - $(T0) )) s so far)"

.PHONY: main test setup demo cuda cuda-check

setup: $(STAMP)

# Build isolation is off: the build's own requirements (pyproject.toml [build-system], jax pinned to the
# FFI headers' version) go into the venv first, so pip does not download jax/jaxlib a second time into a
# throwaway build environment.
# The package's __init__ files too: the editable install maps each module to its file, so a package added or moved
# (a pull) must reinstall, or imports resolve to the old paths.
$(STAMP): pyproject.toml CMakeLists.txt $(wildcard kernels/*/*) $(wildcard turbo_moe/__init__.py turbo_moe/*/__init__.py turbo_moe/*/*/__init__.py)
	$(call stage,1/5,virtualenv $(VENV))
	$(PYTHON) -m venv $(VENV)
	$(call stage,2/5,build requirements (pyproject.toml [build-system]; CMake and Ninja from PyPI only if missing here))
	$(PIP) install $$($(BIN)/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))")
	extra=$$($(BIN)/python -c "from scikit_build_core.build import get_requires_for_build_editable as r; print(' '.join(r()))") && \
	  if [ -n "$$extra" ]; then $(PIP) install $$extra; fi
ifeq ($(WITH_CUDA),1)
	$(call stage,3/5,CUTLASS headers (nvidia-cutlass $(CUTLASS_VERSION) into $(CUTLASS_DIR)))
	$(MAKE) --no-print-directory cutlass
else
	$(call stage,3/5,CUDA library skipped: no GPU listed by nvidia-smi (make setup CUDA=1 builds it anyway))
endif
	$(call stage,4/5,dependencies and the kernels (pip install -e .[dev]; CMake builds kernels/cpu$(if $(filter 1,$(WITH_CUDA)), and kernels/cuda,)))
	$(PIP) install --no-build-isolation -e ".[dev]" $(PIP_BUILD)
	$(call stage,5/5,Jupyter kernel "turbo-moe" in $(VENV) and a check that the kernels load)
	$(BIN)/python -m ipykernel install --prefix $(abspath $(VENV)) --name turbo-moe --display-name "Python (turbo-moe)" >/dev/null
	$(BIN)/python -c "import turbo_moe.ops as ops; print('turbo_moe kernels:', ops.ensure_registered())"
	touch $(STAMP)
	$(call stage,done,set-up finished)

# Headers only: installed without its Python dependencies, outside the venv (so pip never reports the
# dependencies nvidia-cutlass's Python half would need).
.PHONY: cutlass
cutlass: $(CUTLASS_INCLUDE)/cutlass/cutlass.h
$(CUTLASS_INCLUDE)/cutlass/cutlass.h:
	$(PIP) install --no-deps --no-warn-conflicts --upgrade --target $(CUTLASS_DIR) "nvidia-cutlass==$(CUTLASS_VERSION)"

# The libraries for a GPU machine, built here with CMake (no GPU needed, nvcc needed): build/cuda/lib holds
# libturbo_moe_cpu.so and libturbo_moe_cuda.so (and libturbo_moe_cuda_bench.so, the kernel benchmarks' event timer);
# on the GPU machine TURBO_MOE_LIB_DIR=<that folder>.
cuda: | $(STAMP)
	@command -v nvcc >/dev/null || { echo "make cuda: nvcc is not on PATH"; exit 1; }
	$(MAKE) --no-print-directory cutlass
	cmake -S . -B $(CUDA_BUILD) -DPython_EXECUTABLE=$(abspath $(BIN)/python) -DTURBO_MOE_CUDA=ON \
	  -DTURBO_MOE_CPU_ARCH=$(CPU_ARCH) -DTURBO_MOE_CUTLASS_INCLUDE=$(CUTLASS_INCLUDE) \
	  $(if $(shell command -v ninja),-G Ninja,)
	cmake --build $(CUDA_BUILD) -j $(JOBS)
	mkdir -p $(CUDA_BUILD)/lib && cp $(CUDA_BUILD)/libturbo_moe_cpu.so $(CUDA_BUILD)/kernels/cuda/libturbo_moe_cuda.so \
	  $(CUDA_BUILD)/kernels/cuda/libturbo_moe_cuda_bench.so $(CUDA_BUILD)/lib/
	@echo "built: $(CUDA_BUILD)/lib (on the GPU machine: TURBO_MOE_LIB_DIR=$(CUDA_BUILD)/lib)"

cuda-check: cuda

# Two pytest-xdist workers (CI has 2 cores: one compiles while the other runs). `--dist loadfile` keeps a file's
# tests on one worker, so a module-scoped fixture (a training run, the fault campaign, JupyterLab) runs once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treating as a failure"; fi; exit $$rc

# --force: a fresh machine measures its own CPU points into experiments/results/ (git-ignored); the report
# ingests them into experiments/runs/store/ (git-ignored) and draws them together with the committed results
# into experiments/runs/report/, so `git status` stays clean (`turbo-moe report --publish` updates the
# committed store and figures).
# The sweep prints a result line per point and a summary table; that table is shown again at the very end,
# after the report's own lines, with where the report is.
MAIN_LOG := build/main-sweep.log
main: $(STAMP)
	@mkdir -p build
	set -o pipefail; $(BIN)/turbo-moe sweep experiments/sweeps/cpu_default.yaml --force 2>&1 | tee $(MAIN_LOG)
	$(BIN)/turbo-moe report
	@echo; sed -n '/: done; this run/,/^table /p' $(MAIN_LOG)
	@echo "report (git-ignored, this machine's runs beside the committed ones): experiments/runs/report/results.md" \
	  "(the results table), experiments/runs/report/*.png (the figures), experiments/runs/report/04_report.ipynb"
