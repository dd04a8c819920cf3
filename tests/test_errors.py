"""The library's error messages: short (the failed condition, then the fix), each sentence
written once (a message several raises share is a module constant, ``..._MSG``), and the
constants are what the raises say.

Lengths are estimated from the source, without running the raises: the constant text of a
message counts as written, and each substituted value (a path, a shape, a name) as
:data:`VALUE` characters, what a realistic path or pattern takes.
"""

import ast
import dataclasses
import functools
import pathlib
import re

import saggs_jax

PACKAGE = pathlib.Path(saggs_jax.__file__).parent
LIMIT = 240  # characters in a message, values substituted
VALUE = 30  # characters a substituted value takes
NUMBER = 3  # characters a number takes: an axis, a size, a count, a step
FORMATTED = 8  # characters a number formatted with a spec takes, {x:.3g}: 1.23e-05
SHAPE = 20  # characters a shape takes, (32, 4096, 128); a dtype; a type's name, ScaleByAdamState
# Values read as numbers: these names (or attributes), and len(...) / sum(...).
NUMBERS = re.compile(
  r"(?:^|\.|_)(axis|ax|size|n|k|groups|heads|want|per_copy|low|high|step|ndim|index|count|KEEP)$"
  r"|^(len|sum|int)\(|^axes\[\d\]$|\[(axis|ax)\]$"
)
# A location joined from values ({where}.{field}[{path!r}]) takes as many characters as
# opt_state[0].v_row['layers/0/attn/q_proj/kernel'].
LOCATION = 50
SENTENCE = 40  # a sentence this long is written in one place only


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    for child in ast.iter_child_nodes(node):
      child.parent = node  # type: ignore[attr-defined]
  return tree


def _module_path(path: pathlib.Path, node: ast.ImportFrom) -> pathlib.Path | None:
  """The file ``from ... import`` reads, if it is in the package."""
  base = path.parent
  for _ in range(node.level - 1):
    base = base.parent
  if not node.level:
    if not (node.module or "").startswith("saggs_jax"):
      return None
    base, parts = PACKAGE.parent, (node.module or "").split(".")
  else:
    parts = (node.module or "").split(".") if node.module else []
  target = base.joinpath(*parts)
  for candidate in (target.with_suffix(".py"), target / "__init__.py"):
    if candidate.exists():
      return candidate
  return None


@functools.cache
def _globals(path: pathlib.Path) -> dict[str, tuple[pathlib.Path, ast.AST]]:
  """Module-level names: string assignments, functions, and names imported from the package."""
  found: dict[str, tuple[pathlib.Path, ast.AST]] = {}
  for node in _tree(path).body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      if isinstance(node.targets[0], ast.Name):
        found[node.targets[0].id] = (path, node.value)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
      found[node.target.id] = (path, node.value)
    elif isinstance(node, ast.FunctionDef):
      found[node.name] = (path, node)
    elif isinstance(node, ast.ImportFrom) and (source := _module_path(path, node)):
      for alias in node.names:
        defined = _globals(source).get(alias.name)
        if defined is not None:
          found[alias.asname or alias.name] = defined
  return found


def _enclosing(node: ast.AST) -> list[ast.FunctionDef]:
  """The functions around ``node``, innermost first."""
  found = []
  while (node := getattr(node, "parent", None)) is not None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      found.append(node)
  return found


def _local(name: str, at: ast.AST) -> list[ast.AST]:
  """What ``name`` is assigned in the functions around ``at`` (every assignment)."""
  for function in _enclosing(at):
    values = [
      node.value
      for node in ast.walk(function)
      if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
      and node.value is not None
      and any(
        isinstance(t, ast.Name) and t.id == name
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
      )
    ]
    if values:
      return values
  return []


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a piece of message text is written: a string expression in a file."""

  path: pathlib.Path
  node: ast.AST

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(PACKAGE.parent)}:{getattr(self.node, 'lineno', 0)}"


@dataclasses.dataclass
class Message:
  """A message estimated: its length and the text written, values as ``{}``."""

  length: int
  text: str


class _Reader:
  """Estimates message expressions, binding helper parameters to the arguments given."""

  def __init__(self):
    self.sources: dict[tuple[pathlib.Path, int], tuple[Source, str]] = {}

  def value(self, path, node, env, depth=0) -> Message:
    """The estimate of a substituted value: a string expression is read as text; anything
    else (a name of no known string, a repr, a shape) is :data:`VALUE` characters."""
    if depth > 8:
      return Message(VALUE, "{}")
    if (
      isinstance(node, (ast.Constant, ast.JoinedStr, ast.IfExp))
      or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add))
      or (isinstance(node, ast.Call) and _is_format(node))
    ):
      return self.text(path, node, env, depth + 1)
    code = ast.unparse(node)
    if NUMBERS.search(code):
      return Message(NUMBER, "{}")
    if re.search(r"shape|dtype$|__name__$", code):
      return Message(SHAPE, "{}")
    if isinstance(node, ast.Name):
      if node.id in env:
        bound_path, bound = env[node.id]
        return self.value(bound_path, bound, {}, depth + 1) if bound is not None else _unknown()
      local = _local(node.id, node)
      if local:
        read = [self.value(path, v, env, depth + 1) for v in local]
        return max(read, key=lambda m: m.length)
      defined = _globals(path).get(node.id)
      if defined is not None and not isinstance(defined[1], ast.FunctionDef):
        return self.text(defined[0], defined[1], {}, depth + 1)
    if isinstance(node, ast.Call) and _joins(node):
      items = node.args[0]
      if isinstance(items, (ast.GeneratorExp, ast.ListComp)):
        return self.value(path, items.elt, env, depth + 1)  # one item, typically
    return _unknown()

  def text(self, path, node, env, depth=0) -> Message:
    """The estimate of a string expression written in the source (recorded as a source)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      message = Message(len(node.value), node.value)
    elif isinstance(node, ast.JoinedStr) and _location(node):
      return Message(LOCATION, "{}")
    elif isinstance(node, ast.JoinedStr):
      length, text = 0, ""
      for part in node.values:
        if isinstance(part, ast.Constant):
          length, text = length + len(part.value), text + str(part.value)
        elif part.format_spec is not None:  # type: ignore[attr-defined]
          length, text = length + FORMATTED, text + "{}"
        else:
          inner = self.value(path, part.value, env, depth + 1)  # type: ignore[attr-defined]
          length, text = length + inner.length, text + "{}"
      message = Message(length, text)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
      left = self.value(path, node.left, env, depth + 1)
      right = self.value(path, node.right, env, depth + 1)
      return Message(left.length + right.length, left.text + right.text)
    elif isinstance(node, ast.IfExp):
      branches = [self.value(path, b, env, depth + 1) for b in (node.body, node.orelse)]
      return max(branches, key=lambda m: m.length)
    elif isinstance(node, ast.Call) and _is_format(node):
      template = self.value(path, node.func.value, env, depth + 1)  # type: ignore[attr-defined]
      fields = re.findall(r"\{[^{}]*\}", template.text)
      given = {k.arg: k.value for k in node.keywords if k.arg}
      length = template.length
      for field in fields:
        name = field[1:-1].split("!")[0].split(":")[0]
        value = given.get(name)
        count = VALUE if value is None else self.value(path, value, env, depth + 1).length
        length += count - len(field)
      return Message(length, template.text)
    else:
      return self.value(path, node, env, depth + 1)
    self.sources.setdefault((path, id(node)), (Source(path, node), message.text))
    return message

  def raised(self, path, exc: ast.AST) -> Message | None:
    """The message of ``raise exc``: an exception class called with its message first, or a
    helper of the module that returns one (its parameters bound to the arguments)."""
    if isinstance(exc, ast.Name):  # an exception made earlier in the function
      made = [v for v in _local(exc.id, exc) if isinstance(v, ast.Call)]
      read = [m for m in (self.raised(path, v) for v in made) if m is not None]
      return max(read, key=lambda m: m.length) if read else None
    if not isinstance(exc, ast.Call):
      return None
    helper = None
    if isinstance(exc.func, ast.Name):
      defined = _globals(path).get(exc.func.id)
      if defined is not None and isinstance(defined[1], ast.FunctionDef):
        helper = defined
    if helper is None:
      if not exc.args:
        return None
      return self.text(path, exc.args[0], {})
    helper_path, function = helper
    env = _bind(path, helper_path, function, exc)  # type: ignore[arg-type]
    made = [
      node.value
      for node in ast.walk(function)
      if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and node.value.args
    ]
    read = [self.text(helper_path, m.args[0], env) for m in made]  # type: ignore[attr-defined]
    return max(read, key=lambda m: m.length) if read else None


def _location(node: ast.JoinedStr) -> bool:
  """Whether ``node`` joins several values with punctuation only, as a path into a tree."""
  written = [p.value for p in node.values if isinstance(p, ast.Constant)]
  return len(node.values) - len(written) > 1 and all(len(str(w)) <= 2 for w in written)


def _unknown() -> Message:
  return Message(VALUE, "{}")


def _is_format(node: ast.Call) -> bool:
  return isinstance(node.func, ast.Attribute) and node.func.attr == "format"


def _joins(node: ast.Call) -> bool:
  return isinstance(node.func, ast.Attribute) and node.func.attr == "join" and bool(node.args)


def _bind(path, helper_path, function: ast.FunctionDef, call: ast.Call) -> dict:
  """The helper's parameters bound to the call's arguments, its defaults filling the rest; an
  argument that is no string expression is bound to None (a value)."""
  params = [a.arg for a in function.args.posonlyargs + function.args.args]
  defaults = dict(zip(params[len(params) - len(function.args.defaults) :], function.args.defaults))
  env = {name: (helper_path, value) for name, value in defaults.items()}
  env |= {name: (path, arg) for name, arg in zip(params, call.args)}
  env |= {k.arg: (path, k.value) for k in call.keywords if k.arg}
  text = (ast.Constant, ast.JoinedStr, ast.Name, ast.BinOp, ast.IfExp)
  return {n: (p, v if isinstance(v, text) else None) for n, (p, v) in env.items()}


def raises() -> list[tuple[str, Message]]:
  """Every ``raise`` with a message in the package: ``(file:line, estimate)``."""
  found = []
  reader = _Reader()
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.Raise) and node.exc is not None:
        message = reader.raised(path, node.exc)
        if message is not None:
          found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", message))
  return found


def sentences(text: str) -> list[str]:
  """The sentences of a message's written text (values as ``{}``) at least :data:`SENTENCE`
  characters long, a value standing in as ``{}``."""
  split = re.split(r"(?<=[.;:!?])\s+(?=[A-Z{(`'\"])", text)
  return [s.strip() for s in split if len(s.strip()) >= SENTENCE]


def texts() -> list[tuple[Source, str]]:
  """Every piece of message text the package writes, with where: a constant or a helper
  several raises share is one piece."""
  reader = _Reader()
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.Raise) and node.exc is not None:
        reader.raised(path, node.exc)
  return list(reader.sources.values())


def written() -> dict[str, list[str]]:
  """Each long sentence of the package's messages, with the places (``file:line``) that write
  it."""
  found: dict[str, list[str]] = {}
  for source, text in texts():
    for sentence in sentences(text):
      found.setdefault(sentence, []).append(source.where)
  return found


def test_every_message_is_short():
  found = raises()
  assert len(found) > 100  # the probe reads the raises
  long = [
    f"{where}: {m.length} characters: {m.text[:80]}..." for where, m in found if m.length > LIMIT
  ]
  assert not long, "\n".join(long)


def test_no_sentence_is_written_twice():
  repeated = {s: places for s, places in written().items() if len(set(places)) > 1}
  assert not repeated, "\n".join(f"{places}: {s}" for s, places in repeated.items())


def test_every_page_a_message_points_to_exists():
  pages = {page for _, text in texts() for page in re.findall(r"docs/\w+\.md", text)}
  assert "docs/moments.md" in pages  # the probe reads the messages
  missing = [page for page in pages if not (PACKAGE.parent / page).exists()]
  assert not missing, missing


def test_the_estimate_counts_written_text_and_values(tmp_path):
  """The estimator on a module written here: text as written, a value as :data:`VALUE`, a
  number :data:`NUMBER`, a shape :data:`SHAPE`, a constant's fields as the values given."""
  source = tmp_path / "module.py"
  source.write_text(
    'MSG = "{name} fails at {path!r}. Pass fix=."\n'
    "def inline(name, axis, shape):\n"
    '  raise ValueError(f"{name} x {axis} {shape}")\n'
    "def constant(name, path):\n"
    "  raise ValueError(MSG.format(name=name, path=path))\n"
    "def helper(what):\n"
    '  return TypeError(f"{what}: broken.")\n'
    "def through_helper():\n"
    '  raise helper("abc")\n'
  )
  reader = _Reader()
  found = [
    reader.raised(source, node.exc)
    for node in ast.walk(_tree(source))
    if isinstance(node, ast.Raise) and node.exc is not None
  ]
  lengths = [m.length for m in found if m is not None]
  constant = len("{name} fails at {path!r}. Pass fix=.") - len("{name}{path!r}") + 2 * VALUE
  assert lengths == [VALUE + 3 + NUMBER + 1 + SHAPE, constant, len("abc: broken.")]
  assert sentences("Its axis 3 is out of range for the leaf {}. Pass axes= within it.") == [
    "Its axis 3 is out of range for the leaf {}."
  ]


# --- Each constant, as a raise says it ------------------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import saggs_jax as saggs  # noqa: E402
from saggs_jax._src import pairs, shard_map_groups, transport  # noqa: E402
from saggs_jax._src.plan import resolve  # noqa: E402


def test_too_few_copy_axes_is_the_constant():
  pair = saggs.Pair("q", "k", axes=(0, 0), stacked=3)
  params = {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))}
  want = pairs.COPY_AXES_MSG.format(where=pair.label, path="q", shape=(4, 4), copy=(0, 1, 2))
  with pytest.raises(ValueError, match=re.escape(want) + "$"):
    resolve([pair], params)


def test_an_unregistered_state_holding_a_parameter_image_is_the_constant():
  import typing

  class Moments(typing.NamedTuple):
    nu: typing.Any

  params = {"q": jnp.ones((2, 4)), "k": jnp.ones((3, 4))}
  plan = resolve([saggs.Pair("q", "k", axes=(1, 1))], params)
  fix = "Register its degrees: saggs_jax.register_transport(Moments, ...)."
  want = transport.UNREGISTERED_MSG.format(name="Moments", where="opt_state", hit="nu/k", fix=fix)
  with pytest.raises(TypeError, match=re.escape(want) + "$"):
    transport.transport(plan, Moments(params), {"q|k": jnp.ones(4)})


def _shard_mapped(tx, params, *, init_inside: bool):
  """One ``tx`` step inside ``shard_map`` over a one-device mesh: every axis manual."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), params)

  def step(p, state):
    state = tx.init(p) if init_inside else state
    return tx.update(p, state, p)[0]

  state = None if init_inside else tx.init(params)
  state_specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
  fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs), out_specs=specs)
  return jax.jit(fn)(params, state)


SHARDED = {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))}
END = r"(\n|$)"  # jax appends a note on its filtered frames to an error raised under jit


def test_saggs_inside_shard_map_without_axis_name_is_the_constant():
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs([saggs.Pair("q", "k", axes=(1, 1))]))
  _, tail = shard_map_groups.SHARD_MAP_AXIS_MSG.split("{manual}")
  with pytest.raises(ValueError, match=re.escape(tail) + END):
    _shard_mapped(tx, SHARDED, init_inside=False)


def test_groups_inside_shard_map_without_global_shapes_is_the_constant():
  pair = saggs.Pair("q", "k", axes=(1, 1), groups=2)
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs([pair], axis_name="x"))
  want = shard_map_groups.SHARD_MAP_SHAPES_MSG.format(
    pair=pair.label, groups=2, axis=1, path="q", axis_name="x"
  )
  with pytest.raises(ValueError, match=re.escape(want) + END):
    _shard_mapped(tx, SHARDED, init_inside=True)
