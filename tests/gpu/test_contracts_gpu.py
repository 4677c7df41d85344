"""The CUDA handlers refuse each bad call of tests/ops/test_contracts.py (the same CASES) with the same message as
the CPU handlers: both call one contract, kernels/contracts/<op>.h. Skipped without a CUDA device:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu/test_contracts_gpu.py -q
"""
import jax
import pytest

from tests.gpu import GPU, requires_gpu
from tests.ops.test_contracts import CASES, call_message
from turbo_moe.ops._ffi import CPU_ONLY_TARGETS

pytestmark = requires_gpu


@pytest.mark.parametrize("case", [c for c in CASES if c.target not in CPU_ONLY_TARGETS], ids=lambda c: c.name)
def test_cuda_handler_refuses_like_the_cpu_handler(case):
    on_gpu = call_message(case, GPU)
    assert on_gpu == case.message
    assert on_gpu == call_message(case, jax.devices("cpu")[0])  # the CPU handler as run here (JAX_PLATFORMS=cuda,cpu)
