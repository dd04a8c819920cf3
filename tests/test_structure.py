"""The package's own structure: what ``import saggs_jax`` loads, and how its modules import each
other (no cycles, no module reading another's private names)."""

import ast
import pathlib
import subprocess
import sys

import saggs_jax
from xla_env import cpu_env

PACKAGE = pathlib.Path(saggs_jax.__file__).parent

OPTIONAL = ("flax", "chex", "orbax", "tensorstore")  # loaded only where used, or never


def test_import_loads_no_optional_library():
  code = "import sys, saggs_jax; print(sorted({m.split('.')[0] for m in sys.modules}))"
  out = subprocess.run(
    [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, check=True
  )
  loaded = set(eval(out.stdout))
  assert "saggs_jax" in loaded and "jax" in loaded  # the probe itself works
  assert not loaded & set(OPTIONAL), sorted(loaded & set(OPTIONAL))


def test_the_harness_is_not_in_the_package():
  assert not (PACKAGE / "testing").exists()  # the wheel carries what is under PACKAGE
  assert (PACKAGE.parent / "harness" / "lm.py").exists()  # the repository's folder instead


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


MODULES = _modules()


def _type_checking_only(node: ast.AST) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str) -> list[tuple[str, str | None, int]]:
  """``(module, imported name or None, line)`` for each import in module ``name`` (those
  under ``if TYPE_CHECKING:`` left out: they never run). ``from pkg import sub`` of a
  submodule counts as importing ``pkg.sub``."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found, todo = [], list(ast.parse(path.read_text()).body)
  while todo:
    node = todo.pop()
    if _type_checking_only(node):
      continue
    todo.extend(ast.iter_child_nodes(node))
    if isinstance(node, ast.Import):
      found += [(a.name, None, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}".rstrip(".")
      for a in node.names:
        sub = f"{base}.{a.name}"
        found.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
  return found


def test_no_module_imports_the_harness():
  bad = [(m, i, n) for m in MODULES for i, _, n in _imports(m) if i.split(".")[0] == "harness"]
  assert not bad, bad


def test_no_module_imports_another_modules_private_names():
  bad = []
  for name in MODULES:
    for module, imported, line in _imports(name):
      if not module.startswith("saggs_jax") or module == name:
        continue
      if imported is not None and imported.startswith("_"):
        bad.append(f"{name}:{line} imports {module}.{imported}")
      *package, last = module.split(".")
      # a private module belongs to its package: its siblings may import it
      if last.startswith("_") and not (name + ".").startswith(".".join(package) + "."):
        bad.append(f"{name}:{line} imports the private module {module}")
  assert not bad, "\n".join(bad)


def test_no_import_cycles():
  graph = {m: {i for i, _, _ in _imports(m) if i in MODULES and i != m} for m in MODULES}
  # a package's __init__ imports its modules; a module importing its own package ("import
  # saggs_jax as saggs" inside saggs_jax) closes a cycle through it, so those edges count.
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(m, path):
    state[m] = 1
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        cycle = path[path.index(n) :] + [n]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if n not in state:
        visit(n, path + [n])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])


TESTS = PACKAGE.parent / "tests"
# Modules whose tests live in theme files for now (one file per theme spans several modules).
THEMES = {
  "saggs_jax.canonical": "test_checkpoint.py",  # canonicalize, and restoring through it
  "saggs_jax.norms": "test_transform.py",
  "saggs_jax.presets": "test_models.py",  # each preset on its model layout
  "saggs_jax.scan_axes": "test_copy_axes.py",  # copy axes read off Flax scan metadata
  "saggs_jax.discovery.candidates": "test_discover_helpers.py",
  "saggs_jax.discovery.confirmation": "test_discover_guards.py",
  "saggs_jax.discovery.declarations": "test_discover_helpers.py",
  "saggs_jax.discovery.pipeline": "test_discover.py",
  "saggs_jax.discovery.program": "test_discover_helpers.py",
  "saggs_jax.discovery.propagation": "test_discover_helpers.py",
  "saggs_jax.discovery.result": "test_discover.py",
  "saggs_jax.equivariant._gather": "test_equivariant_sharding.py",
  "saggs_jax.equivariant._linalg": "test_equivariant.py",
  "saggs_jax.equivariant.rules": "test_equivariant.py",
}


def test_every_module_has_its_tests():
  """tests/test_<module>.py for each module (a private one without its underscore), or the
  theme file that THEMES names for it."""
  missing = []
  for name, path in MODULES.items():
    if path.name == "__init__.py":
      continue
    own = TESTS / f"test_{path.stem.lstrip('_')}.py"
    if not own.exists() and not (TESTS / THEMES.get(name, own.name)).exists():
      missing.append(f"{name}: neither {own.name} nor a theme file")
    assert not (own.exists() and name in THEMES), f"{name} has {own.name}: drop it from THEMES"
  assert not missing, "\n".join(missing)
