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

from flexfloor_jax import memory
from flexfloor_jax.model import param_count
from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.runtime import mesh as mesh_lib


@pytest.mark.parametrize("name,expected", [("8x7b", 46.70e9), ("8x22b", 140.6e9),
                                           ("qwen3-30b-a3b", 30.5e9),
                                           ("qwen3-235b-a22b", 235.0e9),
                                           ("gpt-oss-20b", 20.91e9),
                                           ("gpt-oss-120b", 116.83e9)])
def test_full_size_parameter_count(name, expected):
  """Published sizes (Mixtral-8x7B 46.7B, 8x22B 140.6B; Qwen3-30B-A3B 30.5B, Qwen3-235B-A22B
  235B; gpt-oss-20b 20.91B, gpt-oss-120b 116.83B, as their model cards give them) from the
  leaves of the abstract params: ShapeDtypeStructs only, nothing allocated."""
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
  assert sharded == set(tr.EXPERT_ARRAYS) & set(abstract["layers"])
  assert sharded == ({"w1", "w3", "w2", "b1", "b3", "b2"} if cfg.expert_bias
                     else {"w1", "w3", "w2"})
  assert all(specs[k] == mesh_lib.replicated_spec() for k in ("embed", "final_norm", "lm_head"))
  assert tuple(specs["layers"]["w1"]) == (None, mesh_lib.mesh_axis("expert"))
  if cfg.qk_norm:  # one RMSNorm weight over the head dim for q and for k, per layer
    assert abstract["layers"]["q_norm"].shape == (cfg.num_layers, cfg.head_dim)


@pytest.mark.parametrize("name,active,embedding", [
    ("qwen3-30b-a3b", 3.3e9, True), ("qwen3-235b-a22b", 22e9, True),
    ("gpt-oss-20b", 3.61e9, False), ("gpt-oss-120b", 5.13e9, False)])
def test_active_parameters(name, active, embedding):
  """The published activated sizes (A3B: 3.3B, A22B: 22B; gpt-oss 3.61B and 5.13B, which leave
  the input embedding table out): everything but the experts plus top_k experts of every layer,
  from the dimensions (the simulator's per-token weights)."""
  cfg = PRESETS[name]
  n_expert = param_count.expert_params(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                                       bias=cfg.expert_bias)
  n = cfg.param_count() - (cfg.num_experts - cfg.top_k) * n_expert
  n -= 0 if embedding else cfg.vocab_size * cfg.hidden_size
  assert abs(n - active) <= 0.03 * active, f"{name}: {n / 1e9:.3f}B active"


def test_memory_cli_prints_the_floor_of_a_qwen3_preset(capsys):
  """`python -m flexfloor_jax.memory --preset qwen3-30b-a3b`: the floor's terms of the family's
  own config (configs/qwen3_moe.py), one expert slot = 48 layers of 3 x 2048 x 768 bf16."""
  memory.main(["--preset", "qwen3-30b-a3b", "--device_memory_gb", "80"])
  out = capsys.readouterr().out
  assert out.startswith("qwen3-30b-a3b (bfloat16): 128 experts"), out
  expert_gib = 48 * 3 * 2048 * 768 * 2 / 2**30
  assert f"expert slot  {expert_gib:9.3f} GiB" in out, out
  assert "floor: " in out and "no floor" not in out, out


def test_memory_cli_takes_every_family_preset(capsys):
  """Each full-size preset's floor terms print from its family's config file."""
  for name in ("qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b"):
    memory.main(["--preset", name, "--device_memory_gb", "80"])
    out = capsys.readouterr().out
    assert out.startswith(f"{name} (bfloat16)") and "expert slot" in out and "floor" in out, out


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
