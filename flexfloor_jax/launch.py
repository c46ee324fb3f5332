"""`python -m flexfloor_jax.launch --num_processes=2 -- <command>`: the local multi-process
launcher (flexfloor_jax.runtime.launch)."""

from absl import app

from flexfloor_jax.config.cli import parse_flags
from flexfloor_jax.runtime.launch import main

if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)  # a flag that does not parse: one `error:` line
