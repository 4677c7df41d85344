"""The CPU grouped GEMM's run-time ISA dispatch (kernels/cpu/dispatch.cc): the variant in use is one the
library reports, and the portable baseline (TURBO_MOE_CPU_ISA=base, what a CPU without AVX2 runs) gives
the dispatched variant's results within float32 tolerance (they differ only by FMA contraction).
"""
import ctypes
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import grouped_gemm, grouped_gemm_weight_grad
from turbo_moe.ops._ffi import CPU_LIBRARY, find_library

M, K, N, G = 203, 300, 150, 4  # ragged edges in every blocking dimension
SIZES = [70, 0, 101, 25]       # an empty group, 7 rows in no group

_COMPUTE = """
import sys, numpy as np, jax, jax.numpy as jnp
from turbo_moe.ops import grouped_gemm, grouped_gemm_weight_grad
k = jax.random.split(jax.random.key(0), 3)
a = jax.random.normal(k[0], ({M}, {K})); w = jax.random.normal(k[1], ({G}, {K}, {N}))
d = jax.random.normal(k[2], ({M}, {N})); s = jnp.asarray({SIZES}, jnp.int32)
np.savez(sys.argv[1], fwd=grouped_gemm(a, w, s), dgrad=grouped_gemm(d, w, s, transpose_rhs=True),
         wgrad=grouped_gemm_weight_grad(a, d, s))
""".format(M=M, K=K, N=N, G=G, SIZES=SIZES)


def _isa() -> str:
    lib = ctypes.CDLL(str(find_library(CPU_LIBRARY)))
    fn = lib.turbo_moe_cpu_gemm_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def test_the_variant_in_use_is_a_known_one():
    isa = _isa()
    assert isa in ("base", "x86-64-v3", "x86-64-v4")
    if platform.machine() not in ("x86_64", "AMD64"):
        assert isa == "base"


def test_baseline_matches_the_dispatched_variant(tmp_path):
    out = tmp_path / "base.npz"
    env = dict(os.environ, TURBO_MOE_CPU_ISA="base", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _COMPUTE, str(out)], env=env, check=True, timeout=300)
    base = np.load(out)
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU kernels also where a GPU is the default
        k = jax.random.split(jax.random.key(0), 3)
        a, w, d = jax.random.normal(k[0], (M, K)), jax.random.normal(k[1], (G, K, N)), jax.random.normal(k[2], (M, N))
        s = jnp.asarray(SIZES, jnp.int32)
        got = dict(fwd=grouped_gemm(a, w, s), dgrad=grouped_gemm(d, w, s, transpose_rhs=True),
                   wgrad=grouped_gemm_weight_grad(a, d, s))
    for name, value in got.items():
        np.testing.assert_allclose(np.asarray(value), base[name], rtol=1e-5, atol=1e-4, err_msg=name)
    assert not np.any(base["fwd"][sum(SIZES):])  # rows in no group stay zero in the baseline too
