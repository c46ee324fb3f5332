"""Full-size presets by shape only, and a name clash with transformers' optional `kernels` dep."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from packaging.version import Version

from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.runtime import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,expected", [("8x7b", 46.70e9), ("8x22b", 140.6e9)])
def test_full_size_parameter_count(name, expected):
  """Published sizes (Mixtral-8x7B 46.7B, 8x22B 140.6B) from the leaves of the abstract params:
  ShapeDtypeStructs only, nothing allocated."""
  cfg = PRESETS[name]
  abstract = tr.abstract_params(cfg)
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert all(x.dtype == np.dtype(cfg.dtype) for x in leaves)
  n = sum(math.prod(x.shape) for x in leaves)
  assert abs(n - expected) <= 0.005 * expected, f"{name}: {n / 1e9:.3f}B"
  assert n == cfg.param_count()
  assert abstract["layers"]["w1"].shape == (cfg.num_layers, cfg.num_experts, cfg.hidden_size,
                                            cfg.intermediate_size)
  # the untraced shapes the memory floor uses are those of the init
  assert jax.tree.map(lambda a: (a.shape, a.dtype), tr.param_shapes(cfg)) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), abstract)

  # One logical axis per dim of every leaf; a dim named 'expert' is the experts' count, and the
  # expert stacks are the only sharded params (on their expert dim).
  axes = tr.param_logical_axes(abstract)
  size = {"expert": cfg.num_experts, "layer": cfg.num_layers, "embed": cfg.hidden_size,
          "mlp": cfg.intermediate_size, "vocab": cfg.vocab_size}
  for x, ax in zip(leaves, jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))):
    assert len(ax) == x.ndim
    assert all(x.shape[i] == size[a] for i, a in enumerate(ax) if a in size), (x.shape, ax)
  specs = tr.param_specs(abstract)
  sharded = {k for k, s in specs["layers"].items() if not mesh_lib.is_replicated(s)}
  assert sharded == set(tr.EXPERT_KEYS)
  assert all(specs[k] == mesh_lib.replicated_spec() for k in ("embed", "final_norm", "lm_head"))
  assert tuple(specs["layers"]["w1"]) == (None, mesh_lib.mesh_axis("expert"))


_PROBE = textwrap.dedent("""
    import importlib.util, json, os
    from transformers.utils import import_utils as iu
    spec = importlib.util.find_spec("kernels")       # our package, importable (not imported)
    avail, version = iu._is_package_available("kernels", return_version=True)
    print(json.dumps({"path": [os.path.realpath(p) for p in spec.submodule_search_locations],
                      "version": version, "available": iu.is_kernels_available(),
                      "min": iu.KERNELS_MIN_VERSION}))
""")


def test_transformers_does_not_mistake_our_kernels_package(monkeypatch):
  """transformers 5.x decides `is_kernels_available()` by find_spec('kernels') plus the version
  of the distribution that owns the name (importlib.metadata.packages_distributions): here
  flexfloor-jax, whose 0.x version is below KERNELS_MIN_VERSION (0.18.2), so it is False. Were it
  True, importing any transformers model would run `from flexfloor_jax.kernels import get_kernel, ...` against
  our package and fail. Checked in a fresh interpreter (the result is cached per process)."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert os.path.join(REPO, "kernels") in out["path"], out
  assert out["available"] is False, out
  if out["version"] != "N/A":  # the owning distribution's version: must stay below the range
    assert Version(out["version"]) < Version(out["min"]), out

  # The fallback when no distribution claims the name (an install whose metadata lacks
  # top_level.txt): transformers imports the package and reads its __version__.
  iu = pytest.importorskip("transformers.utils.import_utils")
  monkeypatch.setattr(iu, "_candidate_distribution_names", lambda name: [])
  exists, version = iu._is_package_available("kernels", return_version=True)
  assert version == "N/A" or Version(version) < Version(iu.KERNELS_MIN_VERSION), version
