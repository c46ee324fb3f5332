"""Full-size presets by shape only, and the name `kernels`, which transformers' optional
dependency owns."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from checkout import ROOT

from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.runtime import mesh as mesh_lib


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
  for x, ax in zip(leaves, jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple)),
                   strict=True):
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
    import flexfloor_jax.kernels as ours
    spec = importlib.util.find_spec("kernels")
    print(json.dumps({"kernels": os.path.realpath(spec.origin) if spec and spec.origin else None,
                      "available": iu.is_kernels_available(),
                      "ours": os.path.realpath(ours.__file__)}))
""")


def test_transformers_never_takes_our_kernels_for_its_own():
  """transformers imports Hugging Face's `kernels` package when is_kernels_available() says so;
  our Pallas kernels install as flexfloor_jax.kernels and claim no top-level name. In a fresh
  interpreter started as the suite starts its children (-P: the checkout's root, and with it its
  kernels/ folder, off sys.path), the name `kernels` that transformers would import is never the
  checkout's folder, and ours load under the package."""
  pytest.importorskip("transformers")
  res = subprocess.run([sys.executable, "-P", "-c", _PROBE], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out["ours"] == str((ROOT / "kernels" / "__init__.py").resolve()), out
  theirs = out["kernels"]
  ours_dirs = [(ROOT / d).resolve() for d in ("kernels", "flexfloor_jax")]
  assert theirs is None or not any(pathlib.Path(theirs).is_relative_to(d) for d in ours_dirs), out
  if out["available"]:
    assert theirs is not None, out
