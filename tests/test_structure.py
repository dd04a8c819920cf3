"""The package's own structure: what ``import saggs_jax`` loads, and how its modules import each
other (no cycles, no module reading another's private names)."""

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import types

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


# The layers of saggs_jax._src, in order (docs/architecture.md): a module imports only its
# own layer or the layers before it.
LAYERS = {
  "foundations": (
    "paths",
    "numerics",
    "validation",
    "jaxpr_params",
    "equivariant.linalg",
    "equivariant.gather",
  ),
  "declarations": (
    "pairs",
    "plan",
    "scan_axes",
    "gates",
    "leaf_classes",
    "discovery.program",
    "equivariant.settings",
    "equivariant.matrices",
    "equivariant.dimension_numbers",
    "equivariant.roles",
  ),
  "statistics": ("norms", "balance", "scaling"),
  "moments": ("transport", "proxy", "probe", "degrees"),
  "stages": (
    "stage",
    "shard_map_groups",
    "transform",
    "qk_clip",
    "equivariant.rules",
    "equivariant.stack",
  ),
  "chain": ("chain",),
  "states": ("canonical", "diagnostics", "checksums", "checkpoint"),
  "discovery": (
    "discovery.tags",
    "discovery.primitives",
    "discovery.propagation",
    "discovery.candidates",
    "discovery.confirmation",
    "discovery.declarations",
    "discovery.result",
    "discovery.roles",
    "discovery.pipeline",
  ),
  "presets": ("presets",),
}
RANK = {f"saggs_jax._src.{m}": i for i, layer in enumerate(LAYERS.values()) for m in layer}


def test_every_implementation_module_has_a_layer():
  modules = {n for n, p in MODULES.items() if n.startswith("saggs_jax._src.")}
  modules = {n for n in modules if MODULES[n].name != "__init__.py"}
  assert modules == set(RANK), f"without a layer: {sorted(modules - set(RANK))}; gone: " + str(
    sorted(set(RANK) - modules)
  )


def test_imports_point_up_the_layers():
  """docs/architecture.md's table: a module of ``_src`` imports its own layer or earlier
  ones, never a later one, and never a public namespace (those only re-export)."""
  layer = dict(enumerate(LAYERS))
  bad = []
  for name, rank in RANK.items():
    for module, _, line in _imports(name) if name in MODULES else ():
      if module in PUBLIC:
        bad.append(f"{name}:{line} imports the public namespace {module}")
      elif module in RANK and RANK[module] > rank:
        bad.append(f"{name}:{line} ({layer[rank]}) imports {module} ({layer[RANK[module]]})")
  assert not bad, "\n".join(bad)


TESTS = PACKAGE.parent / "tests"


# The modules that hold code: those under _src, and a public module that is not a facade of
# one there (a facade, such as saggs_jax.checkpoint, re-exports what its _src twin tests).
_IMPLEMENTED = {
  name: path
  for name, path in MODULES.items()
  if path.name != "__init__.py"
  and ("._src." in name or f"saggs_jax._src.{name.split('.', 1)[1]}" not in MODULES)
}


def _own_test_file(name: str) -> str:
  """``test_<stem>.py``, a private module's stem without its underscore; a module of a
  subpackage whose stem another module shares gets ``test_<subpackage>_<stem>.py``."""
  stem = MODULES[name].stem.lstrip("_")
  clash = sum(p.stem.lstrip("_") == stem for p in _IMPLEMENTED.values()) > 1
  package = name.split(".")[-2]
  return f"test_{package}_{stem}.py" if clash and package != "_src" else f"test_{stem}.py"


def test_every_module_has_its_tests():
  """Every module has its own file, tests/test_<module>.py (see :func:`_own_test_file`),
  holding the tests of its functions; theme files (trajectories, sharding, the optimizer battery)
  stand beside them, not instead."""
  files = {name: _own_test_file(name) for name in _IMPLEMENTED}
  missing = [f"{name}: {file}" for name, file in files.items() if not (TESTS / file).exists()]
  assert not missing, "\n".join(missing)
  assert len(set(files.values())) == len(files), files


def _public(module) -> dict[str, object]:
  """The public names of ``module``: its ``__all__``, else what it defines without an
  underscore (re-exported imports left to the module they come from)."""
  if hasattr(module, "__all__"):
    return {n: getattr(module, n) for n in module.__all__}
  return {
    n: v
    for n, v in vars(module).items()
    if not n.startswith("_") and getattr(v, "__module__", module.__name__) == module.__name__
  }


# The public namespaces: everything else is saggs_jax._src, the implementation.
PUBLIC = (
  "saggs_jax",
  "saggs_jax.equivariant",
  "saggs_jax.discovery",
  "saggs_jax.checkpoint",
  "saggs_jax.presets",
)
SURFACE_LIMIT = 55  # public names in all, modules not counted


def _namespaces() -> list[types.ModuleType]:
  return [importlib.import_module(m) for m in PUBLIC]


# What users import: every public name of every public namespace.
API = {
  f"{m.__name__}.{n}": v
  for m in _namespaces()
  for n, v in _public(m).items()
  if not inspect.ismodule(v) and n != "TYPE_CHECKING"
}


def test_the_public_namespaces_are_the_only_modules_outside_src():
  outside = {n for n in MODULES if not (n + ".").startswith("saggs_jax._src.")}
  assert outside == set(PUBLIC), sorted(outside ^ set(PUBLIC))


def test_every_public_looking_name_is_in_an_all():
  """Each namespace lists its names in ``__all__``, and holds nothing else without an
  underscore but the public subpackages: no helper or import reads as API."""
  stray = []
  for module in _namespaces():
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    for name, value in vars(module).items():
      public_module = inspect.ismodule(value) and value.__name__ in PUBLIC
      if not name.startswith("_") and name not in module.__all__ and not public_module:
        stray.append(f"{module.__name__}.{name}")
  assert not stray, f"public-looking names outside every __all__: {stray}"


def test_the_surface_is_small():
  assert 20 < len(API) <= SURFACE_LIMIT, sorted(API)


def _documented() -> set[str]:
  """The qualified names docs/api.md's autodoc directives document."""
  found, module = set(), ""
  for line in (PACKAGE.parent / "docs" / "api.md").read_text().splitlines():
    line = line.strip()
    if m := re.match(r"\.\. (?:currentmodule|automodule):: (\S+)", line):
      module = m.group(1)
    elif m := re.match(r":members: (.+)", line):
      found |= {f"{module}.{n.strip()}" for n in m.group(1).split(",")}
    elif m := re.match(r"\.\. (?:autofunction|autoclass|autodata|py:data|py:class):: (\S+)", line):
      found.add(f"{module}.{m.group(1)}")
  return found


def test_the_api_reference_documents_exactly_the_surface():
  """docs/api.md documents every public object (under one of its names) and nothing else."""
  documented = _documented()
  assert "saggs_jax.chain" in documented  # the parser reads the directives
  unknown = sorted(documented - set(API))
  missing = {id(v): n for n, v in API.items()}
  for name in documented & set(API):
    missing.pop(id(API[name]), None)
  assert not unknown, f"docs/api.md documents names outside the public surface: {unknown}"
  assert not missing, f"public names docs/api.md does not document: {sorted(missing.values())}"


DOCSTRING_LINES = 40  # optax's scale_by_adam has 18; the why goes to docs/ or comments
MODULE_LINES = 600


def _docstrings() -> dict[str, int]:
  """Lines of every docstring of the library (modules, classes, functions)."""
  found = {}
  for name, path in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
          found[f"{name}.{getattr(node, 'name', '')}".rstrip(".")] = len(doc.splitlines())
  return found


def test_docstrings_are_at_optax_length():
  docs = _docstrings()
  assert docs["saggs_jax._src.chain.chain"] > 5  # the probe reads them
  long = {n: k for n, k in docs.items() if k > DOCSTRING_LINES}
  assert not long, f"docstrings over {DOCSTRING_LINES} lines: {long}"


def test_no_module_is_over_its_length():
  lengths = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
  long = {n: k for n, k in lengths.items() if k > MODULE_LINES}
  assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_every_public_function_has_an_example():
  """Functions show their use in an ``Example:`` section (run as a doctest); a class's
  ``Attributes:`` say what it holds, and the functions that take it show it in use."""
  bad = [n for n, v in API.items() if inspect.isfunction(inspect.unwrap(v))]  # type: ignore[arg-type]
  bad = [n for n in bad if not re.search(r"^\s*Example:\s*$", API[n].__doc__ or "", re.MULTILINE)]
  assert not bad, f"no Example: section in {bad}"


def _frozen(value) -> bool:
  if isinstance(value, (dict, list, set, bytearray)):
    return False
  if isinstance(value, types.MappingProxyType):
    return all(_frozen(k) and _frozen(v) for k, v in value.items())
  if isinstance(value, (tuple, frozenset)):
    return all(_frozen(v) for v in value)
  return True


def test_public_tables_are_frozen():
  """A public table is read-only all the way down (``MappingProxyType``, tuples), so that no
  caller can change what every other optimizer in the process reads."""
  tables = {n: v for n, v in API.items() if not callable(v)}
  assert "saggs_jax.equivariant.REFERENCE" in tables  # the probe sees the tables
  bad = [n for n, v in tables.items() if not _frozen(v)]
  assert not bad, f"mutable public tables: {bad}"


def _builders() -> dict[str, tuple[str, ...]]:
  """The keyword-only parameter names of every public function of :data:`API`, in order,
  each function once (re-exports share it)."""
  found: dict[int, tuple[str, tuple[str, ...]]] = {}
  for name, value in API.items():
    if inspect.isfunction(inspect.unwrap(value)) and id(value) not in found:  # type: ignore[arg-type]
      params = inspect.signature(value).parameters.values()  # type: ignore[arg-type]
      found[id(value)] = (name, tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY))
  return dict(found.values())


# Keywords that stay flat in every builder that takes them, as optax's own hyperparameters
# (optax.adam and optax.adamw both take b1, b2, eps): each is one number or string,
# and a tuple of them would only lengthen every call. They break a run.
FLAT = {"beta", "eps", "eps_form", "alpha"}
# Builders that share a signature by design, with why.
TWINS = {
  frozenset({"scale_by_left_spectral", "scale_by_right_spectral"}): "the left rule is the "
  "right one centred (the push-through identity): one rule, two defaults of center",
}
# A preset's layout flags: ``bias``, ``stacked`` and ``prefix`` are read one by one, and each
# preset takes the ones its model has.
LAYOUT = ("bias", "stacked", "prefix")
RUN = 3


def _runs(names: tuple[str, ...]) -> set[tuple[str, ...]]:
  """Every run of ``RUN`` consecutive names none of which is :data:`FLAT`."""
  return {
    names[i : i + RUN]
    for i in range(len(names) - RUN + 1)
    if not FLAT & set(names[i : i + RUN]) and names[i : i + RUN] != LAYOUT
  }


def test_no_keyword_list_is_repeated_between_builders():
  """No run of three keyword-only names (same names, same order) appears in two public
  builders: a list that several builders take is one setting (a NamedTuple of
  saggs_jax._src.equivariant.settings, as NewtonSchulz), passed whole."""
  builders = _builders()
  assert builders["saggs_jax.equivariant.scale_by_polar"]  # the probe reads the signatures
  seen: dict[tuple[str, ...], list[str]] = {}
  for name, names in builders.items():
    for run in _runs(names):
      seen.setdefault(run, []).append(name)
  short = lambda n: n.rpartition(".")[2]
  repeated = {
    run: names
    for run, names in seen.items()
    if len(names) > 1 and frozenset(map(short, names)) not in TWINS
  }
  assert not repeated, "\n".join(f"{run} in {names}" for run, names in repeated.items())


def test_the_keyword_check_finds_a_repeated_run():
  assert _runs(("num_heads", "num_kv_heads", "head_dim", "beta")) == {
    ("num_heads", "num_kv_heads", "head_dim")
  }
  assert not _runs(("center", "joint", "beta", "eps")) and not _runs(LAYOUT)


# ---- at most ten parameters (issue 45) -------------------------------------------------------

MAX_PARAMETERS = 10
# Where users call the library: the package and the modules docs/api.md documents.
CALLED = (
  saggs_jax,
  saggs_jax.equivariant,
  saggs_jax.checkpoint,
  saggs_jax.presets,
  saggs_jax.discovery,
)


def _parameters(fn) -> int | None:
  """How many parameters ``fn`` takes (``self``/``cls`` aside; ``*args`` and ``**kwargs``
  count one each); None where Python cannot read its signature (a builtin)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return None
  return sum(1 for n in params if n not in ("self", "cls"))


def _callables() -> dict[str, object]:
  """Every public callable of :data:`CALLED`: its functions and classes (a class called as
  its constructor), and the public methods a class of the library defines itself."""
  found = {}
  for module in CALLED:
    for name, value in _public(module).items():
      if inspect.ismodule(value) or not callable(value):
        continue
      found[f"{module.__name__}.{name}"] = value
      if inspect.isclass(value) and value.__module__.startswith("saggs_jax"):
        for attr, member in vars(value).items():
          if not attr.startswith("_") and inspect.isfunction(inspect.unwrap(member)):
            found[f"{module.__name__}.{name}.{attr}"] = member
  return found


def _too_long(callables: dict[str, object]) -> dict[str, int]:
  counts = {name: _parameters(fn) for name, fn in callables.items()}
  return {name: n for name, n in counts.items() if n is not None and n > MAX_PARAMETERS}


def test_no_public_callable_takes_more_than_ten_parameters():
  """A signature past ten parameters hides settings that belong together: group them in a
  record (Heads, Decoder, LlamaNames, NewtonSchulz) or leave rarely used knobs out."""
  callables = _callables()
  # the probe reaches every module and the builders most likely to grow
  assert {
    "saggs_jax.saggs",
    "saggs_jax.equivariant.scale_by_polar",
    "saggs_jax.equivariant.scale_by_hybrid",
    "saggs_jax.equivariant.symmetry_compatible",
    "saggs_jax.presets.llama",
    "saggs_jax.presets.maxtext",
    "saggs_jax.checkpoint.restore",
    "saggs_jax.discovery.discover",
    "saggs_jax.Pair",
  } <= set(callables)
  too_long = _too_long(callables)
  assert not too_long, "more than ten parameters: " + ", ".join(
    f"{name} ({n})" for name, n in sorted(too_long.items())
  )


def test_the_parameter_check_counts_what_a_caller_passes():
  def eleven(a, b, c, d, e, f, g, h, i, j, *, k=None): ...

  def ten(self, a, *args, b=1, c=2, d=3, e=4, f=5, g=6, h=7, **kw): ...

  assert _too_long({"eleven": eleven, "ten": ten, "len": len}) == {"eleven": 11}
