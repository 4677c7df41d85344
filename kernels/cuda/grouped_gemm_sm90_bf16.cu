// bfloat16 instances of the Hopper grouped GEMM (compiled for sm_90a only).
#include "grouped_gemm_sm90.cuh"
TURBO_MOE_SM90_INSTANCE(bf16, cutlass::bfloat16_t)
