"""Bridges that put turbo_moe's kernels under other JAX codebases' MoE layers.

- maxtext: MaxText's `RoutedMoE` (`maxtext.layers.moe`) runs its expert GEMMs on `turbo_moe.ops.grouped_gemm`;
  under expert parallelism its routed body on turbo's dispatch -> experts -> combine (`maxtext_ep`).
"""
