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


def family_config(name: str, presets: dict[str, str], preset: str = ""):
  """A model family's config file (configs/<name>.py): the Mixtral config of the same scale (its
  rollout, mesh and scheduler fields; configs/mixtral.py tiny for the family's tiny preset, 8x7b
  for the full-size ones) with `preset` set to the family's model preset. `presets` maps the
  file's preset names to model presets (the first is the tiny one, the default); the model
  presets' own names are accepted too (python -m flexfloor_jax.memory passes them)."""
  tiny = next(iter(presets))
  preset = preset or tiny
  model = presets.get(preset, preset)
  if model not in presets.values():
    raise ValueError(f"unknown preset {preset!r} for configs/{name}.py; choose one of "
                     f"{tuple(presets)}")
  c = load_config("mixtral", "tiny" if model == presets[tiny] else "8x7b")
  c.preset = model
  return c
