"""The package's shape, read from its source and its wheel: no import circles (imports inside
functions counted), no in-package import inside a function, host-side policy and the simulator
free of JAX, and the kernels installed as `flexfloor_jax.kernels` with no top-level `kernels`."""

import ast
import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexfloor_jax"
KERNELS = ROOT / "kernels"

# The one list of third-party modules that may be imported inside a function: optional heavy
# dependencies that only some calls need (plots).
LAZY_THIRD_PARTY = ("matplotlib",)


def _module_files() -> dict[str, pathlib.Path]:
  """Dotted module name -> source file, for the package and the kernels (installed under it)."""
  out = {}
  for base, prefix in ((PACKAGE, "flexfloor_jax"), (KERNELS, "flexfloor_jax.kernels")):
    for path in sorted(base.rglob("*.py")):
      rel = path.relative_to(base).with_suffix("")
      if base is PACKAGE and rel.parts[0] == "kernels":  # the link to kernels/
        continue
      parts = [p for p in rel.parts if p != "__init__"]
      out[".".join([prefix, *parts])] = path
  return out


MODULES = _module_files()


def _is_package(name: str) -> bool:
  return MODULES[name].name == "__init__.py"


def _imports(name: str):
  """(node, dotted names it imports, inside a function?) for every import statement."""
  tree = ast.parse(MODULES[name].read_text())
  in_function = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      in_function.update(id(n) for n in ast.walk(node) if n is not node)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield node, [a.name for a in node.names], id(node) in in_function
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = name.split(".") if _is_package(name) else name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
      yield node, [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                   for a in node.names], id(node) in in_function


def _in_package(target: str) -> str | None:
  """The package module an imported name loads (its longest known prefix)."""
  while target and target not in MODULES:
    target = target.rpartition(".")[0]
  return target or None


def _ancestors(name: str) -> set[str]:
  parts = name.split(".")
  return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph() -> dict[str, set[str]]:
  """Module -> the package modules importing it loads: the imported modules, and the packages
  above each (importing a.b.c runs a/__init__.py and a/b/__init__.py first), except the
  module's own packages, which Python has initialised before it (a package's __init__ may
  re-export its own modules)."""
  graph = {}
  for name in MODULES:
    deps = set()
    for _, targets, _ in _imports(name):
      for t in targets:
        mod = _in_package(t)
        if mod:
          deps |= ({mod} | _ancestors(mod)) - _ancestors(name) - {name}
    graph[name] = {d for d in deps if d in MODULES}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan), or one that imports
  itself."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in graph[v]:
        out.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_the_graph_sees_every_module_and_its_imports():
  graph = _graph()
  assert "flexfloor_jax.kernels.grouped_matmul" in graph
  assert "flexfloor_jax.rollout.__main__" in graph
  # a relative import inside kernels/, an import inside a package __init__, and a parent package
  assert "flexfloor_jax.kernels.grouped_matmul" in graph["flexfloor_jax.kernels"]
  assert "flexfloor_jax.engine.engine" in graph["flexfloor_jax.engine"]
  assert "flexfloor_jax.engine" in graph["flexfloor_jax.rollout.runner"]
  assert "flexfloor_jax.engine" not in graph["flexfloor_jax.engine.steps"]  # its own package


def test_cycle_finder_finds_a_circle_and_a_self_import():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"a"}}) == [["a"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
  assert _cycles(_graph()) == []


def test_no_in_package_import_inside_a_function():
  """Inside a function only the optional heavy dependencies of LAZY_THIRD_PARTY are imported."""
  bad = []
  for name in MODULES:
    for node, targets, in_function in _imports(name):
      if in_function and not all(t.split(".")[0] in LAZY_THIRD_PARTY for t in targets):
        bad.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
  assert bad == []


def _source_imports(folder: pathlib.Path, prefix: str):
  for path in folder.glob("*.py"):
    name = ".".join([prefix] + ([] if path.stem == "__init__" else [path.stem]))
    for node, targets, _ in _imports(name):
      for t in targets:
        yield path.name, node, t


# What host-side code may import from the package: policy/ is numpy decisions, reading and
# writing its files through io/ (standard library only); the simulator adds itself, the model's
# dimensions (model/config.py, model/param_count.py) and the page pool a rollout builds from its
# settings (rollout/kv_pool.py, which it replays runs on) and the config schema its flags are
# declared in (config/, with what the settings check names against: the tokenizer's ids, the RL
# task names): none of them imports JAX.
POLICY_ALLOWED = ("flexfloor_jax.policy", "flexfloor_jax.io")
SIM_ALLOWED = POLICY_ALLOWED + ("flexfloor_jax.sim", "flexfloor_jax.model.config",
                                "flexfloor_jax.model.param_count", "flexfloor_jax.rollout.kv_pool",
                                "flexfloor_jax.config", "flexfloor_jax.model.tokenizer",
                                "flexfloor_jax.model.checkpoint_format", "flexfloor_jax.rl.tasks")


@pytest.mark.parametrize("folder, allowed, third_party", [
    ("policy", POLICY_ALLOWED, {"numpy", "matplotlib"}),
    ("sim", SIM_ALLOWED, {"numpy", "matplotlib", "absl"}),
    ("io", ("flexfloor_jax.io",), set()),
])
def test_host_side_sources_import_no_jax(folder, allowed, third_party):
  stdlib = set(sys.stdlib_module_names) | {"__future__"}
  for file, node, target in _source_imports(PACKAGE / folder, f"flexfloor_jax.{folder}"):
    top = target.split(".")[0]
    if top == "flexfloor_jax":
      assert target.startswith(allowed), f"{folder}/{file}: {ast.unparse(node)}"
    else:
      assert top in stdlib | third_party, f"{folder}/{file}: {ast.unparse(node)}"


@pytest.mark.parametrize("folder, allowed", [("policy", POLICY_ALLOWED), ("sim", SIM_ALLOWED)])
def test_host_side_modules_load_no_jax(folder, allowed):
  """All of a folder's modules imported in a fresh interpreter: no jax, flax or jaxlib, and no
  package module outside what the folder may use."""
  mods = sorted(n for n in MODULES if n.startswith(f"flexfloor_jax.{folder}")
                and not n.endswith("__main__"))
  code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
          + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib'))\n"
          + "others = sorted(m for m in sys.modules if m.startswith('flexfloor_jax.')"
          + f" and not m.startswith({allowed!r})"
          + " and m not in ('flexfloor_jax.model', 'flexfloor_jax.rollout', 'flexfloor_jax.rl'))\n"
          + "print(bad, others)\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "[] []"


def test_kernels_import_under_the_package_only():
  import flexfloor_jax.kernels as k

  assert pathlib.Path(k.__file__).resolve() == KERNELS / "__init__.py"
  assert k.grouped_matmul is not None
  spec = importlib.util.find_spec("kernels")  # Hugging Face's package, when transformers has it
  origin = pathlib.Path(spec.origin or "").resolve() if spec else None
  assert origin is None or not (origin.is_relative_to(KERNELS) or origin.is_relative_to(PACKAGE)), \
      origin


def test_wheel_installs_the_kernels_under_the_package(tmp_path):
  """`pip wheel .` (the project's own build backend): every module of the package and of
  kernels/ is in the wheel, the kernels under flexfloor_jax/kernels/, nothing at a top-level
  kernels/."""
  r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                      str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout + r.stderr
  (wheel,) = tmp_path.glob("flexfloor_jax-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  assert not [n for n in names if n.startswith("kernels/")]
  kernels = {f"flexfloor_jax/kernels/{p.relative_to(KERNELS)}" for p in KERNELS.rglob("*.py")}
  package = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
             if p.relative_to(PACKAGE).parts[0] != "kernels"}
  assert kernels | package <= names, sorted((kernels | package) - names)
