import os

# Tests run on the CPU with a few host devices (multi-device tests use them); must be set before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

# XLA's CPU optimisations off: the tests' programs are tiny, compiling them is most of the suite's time, and it takes
# about half as long this way. Results may differ from an optimised build's in the last bit; a test whose claim is
# bit-identity between two programs of the optimised build turns them back on (tests/train/test_split_master.py).
# GPU runs (JAX_PLATFORMS=cuda,...) keep them.
if os.environ["JAX_PLATFORMS"] == "cpu":
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session", autouse=True)
def persistent_compilation_cache(tmp_path_factory):
    """One compilation cache per test session (per xdist worker), empty at the start: programs rebuilt with the
    same shapes (a model re-created per test, a run resumed) compile once. Results do not depend on other runs."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
