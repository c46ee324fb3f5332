"""Host-side modules (policy/, sim/) are numpy: importing them must not pull in jax/flax or the
rest of the package."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICY = ROOT / 'flexfloor_jax' / 'policy'
MODULES = sorted(p.stem for p in POLICY.glob('*.py') if p.stem != '__init__')


def test_import_does_not_load_jax():
  code = ('import sys\n'
          + ''.join(f'import flexfloor_jax.policy.{m}\n' for m in MODULES)
          + 'bad = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "jaxlib"))\n'
          + 'others = sorted(m for m in sys.modules if m.startswith("flexfloor_jax.")'
          + ' and not m.startswith("flexfloor_jax.policy"))\n'
          + 'print(bad, others)\n'
          + 'assert not bad and not others, (bad, others)\n')
  r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 0, r.stdout + r.stderr


def _check_source_imports(folder, allowed_package, allowed_third_party):
  """Every import statement of every file in `folder` (inside functions too): the standard
  library, `allowed_third_party`, or package modules starting with `allowed_package`."""
  stdlib = set(sys.stdlib_module_names)
  for path in folder.glob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or '']
      else:
        continue
      for n in names:
        top = n.split('.')[0]
        if top == 'flexfloor_jax':
          assert n.startswith(allowed_package), f'{path.name} imports {n}'
        else:
          assert top in stdlib or top in allowed_third_party or top == '__future__', \
              f'{path.name} imports {n}'


def test_sources_import_only_numpy_stdlib_and_policy():
  _check_source_imports(POLICY, 'flexfloor_jax.policy', {'numpy', 'matplotlib'})


SIM = ROOT / 'flexfloor_jax' / 'sim'
SIM_MODULES = sorted(p.stem for p in SIM.glob('*.py') if p.stem != '__main__')
# what the simulator may import from the package besides itself and policy/: the model's
# dimensions (model/config.py, no JAX)
SIM_ALLOWED = ('flexfloor_jax.policy', 'flexfloor_jax.sim', 'flexfloor_jax.model.config')


def test_sim_modules_exist():
  assert {'presets', 'costs', 'replay', 'records', 'cluster', 'plot', 'cli'} <= set(SIM_MODULES)
  assert (SIM / '__main__.py').exists()


def test_sim_import_does_not_load_jax():
  """Each sim module in a fresh interpreter of its own: none pulls in jax/flax, and none loads a
  flexfloor_jax module outside policy/, sim/ and model/config.py."""
  for m in SIM_MODULES:
    mod = 'flexfloor_jax.sim' + ('' if m == '__init__' else f'.{m}')
    code = (f'import sys\nimport {mod}\n'
            'bad = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "jaxlib"))\n'
            'others = sorted(m for m in sys.modules if m.startswith("flexfloor_jax.")'
            f' and not m.startswith({SIM_ALLOWED!r}) and m != "flexfloor_jax.model")\n'
            'assert not bad and not others, (bad, others)\n')
    r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (mod, r.stdout + r.stderr)


def test_sim_sources_import_no_jax():
  """At the source level, matplotlib and absl imports inside functions included."""
  _check_source_imports(SIM, SIM_ALLOWED, {'numpy', 'matplotlib', 'absl'})
