import os

# Tests run on the CPU with a few host devices (multi-device tests use them); must be set before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
