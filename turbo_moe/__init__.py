"""turbo-moe: dropless Mixture-of-Experts training in JAX with FFI grouped GEMM and dispatch kernels."""

__version__ = "0.1.0"
