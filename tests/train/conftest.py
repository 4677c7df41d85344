import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def persistent_compilation_cache(tmp_path_factory):
    """Runs with the same step program (determinism, resume) reuse one compilation: CI time, not logic."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
