"""The config files in configs/, loaded by name: no flags and no JAX, so that a config file may
build on another (configs/bench.py on configs/mixtral.py) without importing a command line."""

import importlib.util
import os

# The checkout's root: configs/ lies beside the package.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(name: str, preset: str = ""):
  """get_config(preset) of configs/<name>.py, loaded by path as config_flags loads config files
  (so that it works from any working directory)."""
  path = os.path.join(_REPO, "configs", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"_flexfloor_configs_{name}", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"no config file {path}")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(preset)
