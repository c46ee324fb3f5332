"""One rollout, from a config to its published outputs: inputs (checked before any compile), the
runner's stages (prepare, build engine, execute, summarize, publish), outputs, the paged KV pool
of a run, and the `python -m flexfloor_jax.rollout` entry point (__main__)."""
