"""runtime.compilation_cache: the config's folder turns XLA's persistent cache on, unless
JAX_COMPILATION_CACHE_DIR chose one already (the tests' shared cache); "" leaves it off. A
program compiled with the cache on leaves an entry in the folder."""

import jax
import jax.numpy as jnp
from jax._src import compilation_cache as jax_cache  # reset: the cache is set up once a process

from realm_jax import runtime


def test_the_config_folder_is_used_unless_the_environment_chose_one(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/else")
    assert runtime.compilation_cache(str(tmp_path / "c")) == "/somewhere/else"
    assert not (tmp_path / "c").exists()
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert runtime.compilation_cache("") == ""
    folder = tmp_path / "xla"
    try:
        jax_cache.reset_cache()
        assert runtime.compilation_cache(str(folder)) == str(folder)
        assert jax.config.jax_compilation_cache_dir == str(folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
        assert any(folder.iterdir())  # the compiled program was written there
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax_cache.reset_cache()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
