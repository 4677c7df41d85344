"""compilation_cache.ensure_on: the persistent cache on for CPU runs, never over a cache someone set."""
import os
import subprocess
import sys

import jax
import pytest

from turbo_moe.train import compilation_cache


@pytest.fixture
def no_cache_set():
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_cpu_turns_it_on(no_cache_set, tmp_path):
    folder = tmp_path / "cache"
    assert compilation_cache.ensure_on("cpu", folder) == str(folder)
    assert jax.config.jax_compilation_cache_dir == str(folder) and folder.is_dir()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's cache")
def test_a_fresh_process_writes_its_programs_there(tmp_path):
    """In a process of its own: JAX sets its cache up once per process (this session's conftest already did)."""
    folder = tmp_path / "cache"
    code = (f"import jax, jax.numpy as jnp\n"
            f"from turbo_moe.train.compilation_cache import ensure_on\n"
            f"jax.jit(lambda x: x + 1)(1.0)\n"  # a compile before the cache is on: it still takes effect
            f"assert ensure_on(directory={str(folder)!r}) == {str(folder)!r}\n"
            f"jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
            f"jax.jit(lambda x: jnp.cos(x) @ x.T * 3.0)(jnp.ones((17, 5))).block_until_ready()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert any("cos" in p.name or "lambda" in p.name for p in folder.iterdir()), sorted(folder.iterdir())


def test_a_cache_set_elsewhere_is_kept(no_cache_set, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert compilation_cache.ensure_on("cpu", tmp_path / "ours") == str(tmp_path / "theirs")
    assert not (tmp_path / "ours").exists()


def test_other_platforms_are_left_alone(no_cache_set, tmp_path):
    assert compilation_cache.ensure_on("gpu", tmp_path / "ours") is None
    assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "ours").exists()


def test_an_unwritable_folder_leaves_it_off(no_cache_set, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    assert compilation_cache.ensure_on("cpu", blocker / "cache") is None
    assert jax.config.jax_compilation_cache_dir is None
