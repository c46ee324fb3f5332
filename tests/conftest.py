"""Tests emulate 8 CPU devices; XLA_FLAGS must be set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

# Persistent compilation cache: keeps the suite inside CI's time limit on 2 cores.
_CACHE = os.environ.get("FLEXFLOOR_JAX_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
