# Source this on the GPU machine (jax + flax installed, no internet, the repository copied without
# .git): it points turbo_moe at the libraries and data cache carried from the build machine.
#   build/lead_lib     libturbo_moe_cpu.so + libturbo_moe_cuda.so built for sm_90a
#   build/data_cache   a TURBO_MOE_DATA_DIR holding the Shakespeare cache (tokenizer + tokens)
# and turns on JAX's persistent compilation cache (programs shared between processes of one call).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TURBO_MOE_LIB_DIR=${TURBO_MOE_LIB_DIR:-$PWD/build/lead_lib}
export TURBO_MOE_DATA_DIR=${TURBO_MOE_DATA_DIR:-$PWD/build/data_cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_compilation_cache}
export PYTHONUNBUFFERED=1
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
