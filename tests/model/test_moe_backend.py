"""model.moe_backend: 'auto' | 'xla' | 'pallas' resolved in one place
(flexfloor_jax.model.config.resolve_moe_backend) into the kernels' impl / interpret, checked by
settings.load without jax, and used by EngineSpec and ActorSpec."""

import dataclasses
import subprocess
import sys

import jax
import pytest

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import settings
from flexfloor_jax.config.files import load_config
from flexfloor_jax.engine.sampling import SamplingParams
from flexfloor_jax.model.config import MOE_BACKENDS, PRESETS, resolve_moe_backend
from flexfloor_jax.rl import actor as actor_lib


@pytest.mark.parametrize("name,platform,expected", [
    ("auto", "cpu", ("xla", False)),
    ("auto", "gpu", ("pallas", False)),  # a CUDA device's platform
    ("auto", "cuda", ("pallas", False)),  # a lowering's name for it
    ("auto", "tpu", ("pallas", False)),
    ("auto", "rocm", ("xla", False)),  # no compiled Pallas kernels for ROCm here
    ("xla", "cpu", ("xla", False)),
    ("xla", "gpu", ("xla", False)),
    ("xla", "tpu", ("xla", False)),
    ("pallas", "cpu", ("pallas", True)),  # interpret mode: the CPU parity path
    ("pallas", "gpu", ("pallas", False)),
    ("pallas", "tpu", ("pallas", False)),
])
def test_resolve_moe_backend(name, platform, expected):
  assert resolve_moe_backend(name, platform) == expected


@pytest.mark.parametrize("bad", ["triton", "Pallas", "", None])
def test_resolve_moe_backend_rejects_unknown_names(bad):
  with pytest.raises(ValueError, match="moe_backend"):
    resolve_moe_backend(bad, "cpu")


def test_config_default_is_auto_and_the_check_names_the_field():
  c = load_config("mixtral", "tiny")
  assert c.model.moe_backend == "auto"
  assert c.model.moe_backend in MOE_BACKENDS
  settings.load(c)  # the defaults pass
  for ok in MOE_BACKENDS:
    c.model.moe_backend = ok
    assert settings.load(c).model.moe_backend == ok
  c.model.moe_backend = "triton"
  with pytest.raises(settings.ConfigError) as err:
    settings.load(c)
  msg = str(err.value)
  assert msg.startswith("model.moe_backend: ") and "'triton'" in msg, msg
  assert all(name in msg for name in MOE_BACKENDS), msg


def test_check_needs_no_jax():
  """The field is checked by settings.load, which imports no jax (a fresh interpreter)."""
  code = ("import sys\n"
          "from flexfloor_jax.config import settings\n"
          "from flexfloor_jax.config.files import load_config\n"
          "c = load_config('mixtral', 'tiny')\n"
          "c.model.moe_backend = 'bogus'\n"
          "try:\n"
          "  settings.load(c)\n"
          "except settings.ConfigError as e:\n"
          "  print('error:', e)\n"
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
          "assert not bad, bad\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "error: model.moe_backend" in r.stdout, r.stdout


def test_specs_resolve_auto_for_this_platform():
  """EngineSpec and ActorSpec default to 'auto' and hand the kernels the resolved impl."""
  platform = jax.default_backend()
  cfg = PRESETS["tiny"]
  eng = engine_lib.EngineSpec(cfg=cfg, slots_per_worker=2, expert_slots=4, max_seq_len=32,
                              max_prompt_len=8, max_new_tokens=8,
                              sampling=SamplingParams(0.0, 1.0, 0))
  act = actor_lib.ActorSpec(cfg, 2)
  assert eng.moe_backend == act.moe_backend == "auto"
  for ep in (eng.ep(2, 8), act.ep()):
    assert (ep.backend, ep.interpret) == resolve_moe_backend("auto", platform)
  if platform == "cpu":
    assert eng.ep(2, 8).backend == "xla"
  for backend in ("xla", "pallas"):
    ep = dataclasses.replace(eng, moe_backend=backend).ep(2, 8)
    assert (ep.backend, ep.interpret) == resolve_moe_backend(backend, platform)
  # interpret=True forces Pallas interpret mode whatever the platform
  forced = actor_lib.ActorSpec(cfg, 2, moe_backend="pallas", interpret=True).ep()
  assert forced.backend == "pallas" and forced.interpret
