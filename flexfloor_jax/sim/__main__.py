"""Cluster-scale simulator (flexfloor_jax.sim): the rollout policy the engine runs, on a cost model.

`python -m flexfloor_jax.sim --model=mixtral-8x7b --hardware=tpu-v5p --devices=8,64,256,1024`
`python -m flexfloor_jax.sim --calibrate=bench_out/runs/static_e0.json,\
bench_out/runs/flexfloor_e0.json \
                             --predict=bench_out/runs/flexfloor_e3.json,bench_out/runs/static_e3.json`

This module only starts the command line (flexfloor_jax/sim/cli.py); this docstring is --help's.
"""

import sys

from absl import app, flags

from flexfloor_jax.config import schema
from flexfloor_jax.config.cli import parse_flags
from flexfloor_jax.sim import cli

cli.define_flags()
flags.adopt_module_key_flags(schema)  # --help lists the flags (schema.py defines them) as its own
# parse_flags: a flag that does not parse (--epochs=x) is one `error:` line, exit status 2
app.run(lambda argv: sys.exit(cli.main(argv)), flags_parser=parse_flags)
