# Two entry points for a fresh machine (Linux, Python >= 3.11, a C++ compiler, make):
#   make main   set up, run the CPU default sweep and regenerate the report
#   make test   set up and run the test suite
# Set-up is a virtualenv in .venv with the package installed editable (this builds kernels/ with
# CMake; kernels/cuda too when nvcc is on PATH) and a Jupyter kernel named "turbo-moe".
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.turbo-moe-installed
# The CPU kernels target the portable baseline, as a wheel does, and the grouped GEMM picks its
# AVX2/AVX-512 variant at run time: as fast as -march=native and bit-identical to it on an AVX2 host
# (experiments/NOTES.md, "CPU -march"). Passed explicitly so an older build cache's `native` is replaced;
# `make CPU_ARCH=native` still tunes everything for this machine.
CPU_ARCH ?= $(if $(filter x86_64 amd64,$(shell uname -m)),x86-64-v2,)
PIP_BUILD := -C cmake.define.TURBO_MOE_CPU_ARCH=$(CPU_ARCH)

.PHONY: main test setup demo

setup: $(STAMP)

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard kernels/*/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# With nvcc present, the CUDA build also compiles the Hopper grouped GEMM against the CUTLASS headers
	# of the nvidia-cutlass wheel (headers only: installed without its Python dependencies).
	if command -v nvcc >/dev/null; then \
	  $(BIN)/python -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0" && \
	  cutlass=$$($(BIN)/python -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") && \
	  $(BIN)/python -m pip install -q -e ".[dev]" $(PIP_BUILD) -C cmake.define.TURBO_MOE_CUTLASS_INCLUDE=$$cutlass; \
	else \
	  $(BIN)/python -m pip install -q -e ".[dev]" $(PIP_BUILD); \
	fi
	$(BIN)/python -m ipykernel install --user --name turbo-moe --display-name "Python (turbo-moe)" >/dev/null
	$(BIN)/python -c "import turbo_moe.ops as ops; print('turbo_moe kernels:', ops.ensure_registered())"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treating as a failure"; fi; exit $$rc

# --force: a fresh machine measures its own CPU points (the committed rows are kept in the table);
# the report then draws these together with the committed GPU results.
main: $(STAMP)
	$(BIN)/turbo-moe sweep experiments/sweeps/cpu_default.yaml --force
	$(BIN)/turbo-moe report
