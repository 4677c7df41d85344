"""GPU tests: skipped without a CUDA device. tests/conftest.py defaults JAX to the CPU, so run them
on a GPU machine with the platform named: JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu -q"""
import jax
import pytest

try:
    GPU = jax.devices("gpu")[0]
except RuntimeError:
    GPU = None

requires_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA device (JAX_PLATFORMS=cuda,cpu)")
