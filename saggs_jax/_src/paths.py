"""Pytree paths as "/"-joined strings, and the pattern language that matches them.

A path joins the keys leading to a leaf with "/": dict keys, attribute names and
sequence indices (in decimal). A trailing ``value`` component (a Flax
``Variable`` or ``Partitioned`` box) is dropped, so one pattern addresses the
same weight in a plain dict, a Linen ``{"params": ...}`` tree and an
``nnx.State``.

Patterns are matched against whole segments, anchored at the end of the path:

* ``*`` matches any text inside one segment (``layers_*``, ``*``);
* ``**`` as a whole segment matches any number of segments, zero included;
* everything else is literal.

The segments in front of the matched suffix form an implicit leading capture,
so ``"attn/wq"`` matches ``"params/layers/0/attn/wq"`` with the capture
``("params/layers/0",)``. Captures are what pair the two sides of a symmetry.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Captures = tuple[str, ...]


def key_name(entry: Any) -> str:
  """The text of one key-path entry."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_str(key_path: tuple[Any, ...]) -> str:
  """Joins a ``jax.tree_util`` key path with "/", dropping a trailing ``value``."""
  names = [key_name(e) for e in key_path]
  if len(names) > 1 and names[-1] == "value":
    names.pop()
  return "/".join(names)


def leaves_with_paths(
  tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Iterator[tuple[str, Any]]:
  """Yields ``(path, leaf)`` for every leaf of ``tree``, in flatten order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  for key_path, leaf in flat:
    yield path_str(key_path), leaf


def is_array(leaf: Any) -> bool:
  """Whether ``leaf`` is an array (JAX, NumPy, or abstract ``jax.ShapeDtypeStruct``).

  Any other leaf (a function, a Python number or flag, as an Equinox module
  holds) is static configuration, as ``eqx.filter`` treats it: no pattern
  matches it, nothing rescales or transports it, and a checkpoint takes it
  from the target rather than from the files.
  """
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_parameter(leaf: Any) -> bool:
  """Whether ``leaf`` is a parameter: an array (see :func:`is_array`) of an inexact dtype.

  Integer and boolean arrays (an Equinox module's buffers, step counters) are arrays but
  not parameters: nothing differentiates, balances or transports them.

  Example:
    >>> import jax.numpy as jnp
    >>> [is_parameter(x) for x in (jnp.ones(2), jnp.arange(2), 1.0)]
    [True, False, False]
  """
  return is_array(leaf) and bool(jnp.issubdtype(leaf.dtype, jnp.inexact))


def arrays_with_paths(tree: Any) -> Iterator[tuple[str, Any]]:
  """Yields ``(path, leaf)`` for every array leaf of ``tree`` (see :func:`is_array`), in
  flatten order.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> dict(arrays_with_paths({"w": jnp.ones(2), "act": jax.nn.relu, "p": 0.1}))
    {'w': Array([1., 1.], dtype=float32)}
  """
  return ((path, leaf) for path, leaf in leaves_with_paths(tree) if is_array(leaf))


@functools.cache
def _segments(pattern: str) -> tuple[re.Pattern | None, ...]:
  """Parses a pattern into per-segment regexes; None stands for ``**``."""
  if not pattern or pattern.startswith("/") or pattern.endswith("/"):
    raise ValueError(f"Bad path pattern {pattern!r}: expected segments joined by '/'.")
  out = []
  for segment in pattern.split("/"):
    if segment == "**":
      out.append(None)
    elif "**" in segment:
      raise ValueError(f"Bad path pattern {pattern!r}: '**' must be a whole segment.")
    else:
      out.append(re.compile("([^/]*)".join(re.escape(s) for s in segment.split("*"))))
  return tuple(out)


def num_captures(pattern: str) -> int:
  """How many captures a match of ``pattern`` yields, the implicit prefix included."""
  return 1 + sum(1 if s is None else s.groups for s in _segments(pattern))


def _match_from(pat, segs) -> list[str] | None:
  if not pat:
    return [] if not segs else None
  head, rest = pat[0], pat[1:]
  if head is None:  # '**': shortest span first
    for k in range(len(segs) + 1):
      tail = _match_from(rest, segs[k:])
      if tail is not None:
        return ["/".join(segs[:k])] + tail
    return None
  if not segs:
    return None
  m = head.fullmatch(segs[0])
  if m is None:
    return None
  tail = _match_from(rest, segs[1:])
  return None if tail is None else list(m.groups()) + tail


@functools.lru_cache(maxsize=65536)
def match(pattern: str, path: str) -> Captures | None:
  """The captures of ``pattern`` on ``path``, or None when it does not match.

  The first capture is the implicit prefix in front of the matched suffix.
  """
  pat = _segments(pattern)
  segs = path.split("/") if path else []
  for start in range(len(segs) + 1):
    caps = _match_from(pat, segs[start:])
    if caps is not None:
      return ("/".join(segs[:start]), *caps)
  return None


def nearest(pattern: str, candidates: Iterable[str], n: int = 3) -> list[str]:
  """Up to ``n`` of ``candidates`` whose trailing segments read most like ``pattern``, best first.

  A pattern is anchored at the end of a path, so each path is scored by its
  closest suffix of whole segments (``difflib`` ratio, at least 0.6). Paths
  whose closest suffixes differ only in their numbers (one weight in every
  layer) are suggested once, by the closest (the first on a tie).

  Example:
    >>> nearest("atn/q_proj", ["layers/0/attn/q_proj", "layers/1/attn/q_proj", "head"])
    ['layers/0/attn/q_proj']
  """
  matcher = difflib.SequenceMatcher(b=pattern)
  scores: dict[str, float] = {}

  def score(suffix: str) -> float:
    if suffix not in scores:
      matcher.set_seq1(suffix)
      scores[suffix] = matcher.ratio()
    return scores[suffix]

  best: dict[str, tuple[float, str]] = {}  # closest suffix, numbers blanked -> (score, path)
  for path in candidates:
    segs = path.split("/")
    suffix = max(("/".join(segs[i:]) for i in range(len(segs))), key=score)
    key = re.sub(r"\d+", "#", suffix)
    if score(suffix) >= 0.6 and score(suffix) > best.get(key, (0.0,))[0]:
      best[key] = (score(suffix), path)
  ranked = sorted(best.values(), key=lambda sp: -sp[0])
  return [path for _, path in ranked[:n]]


# Layouts: what a checkpoint records of a tree, and what init_from and canonicalize(tx=) check.

Layout = dict[str, str]  # path -> "float32[3, 4]", "key<fry>[]" or an empty node "EmptyState()"


def is_empty(node) -> bool:
  """A node without leaves (``None``, ``EmptyState()``, ``MaskedNode()``, ``{}``)."""
  return jax.tree.structure(node).num_leaves == 0


def _describe(leaf) -> str:
  if is_empty(leaf):
    return "None" if leaf is None else f"{type(leaf).__name__}()"
  if not is_array(leaf):
    return "static"
  return f"{leaf.dtype}{list(np.shape(leaf))}"


def layout(tree: Any) -> Layout:
  """``{path: "dtype[shape]"}`` for every array leaf of ``tree``, ``{path: "Type()"}`` for
  every empty node and ``{path: "static"}`` for every other leaf, in flatten order
  (JSON-ready).

  Empty nodes are recorded because optimizers that differ only in them
  (``optax.adam`` and ``optax.adamw``) have the same leaves. A static leaf (a
  function, a Python number or flag, as an Equinox module holds; see
  :func:`is_array`) is not saved: :func:`saggs_jax.checkpoint.restore` takes it
  from the target.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> saggs.checkpoint.layout(optax.adam(1e-3).init({"w": jnp.ones((2, 3))}))
    {'0/count': 'int32[]', '0/mu/w': 'float32[2, 3]', '0/nu/w': 'float32[2, 3]', '1': 'EmptyState()'}
  """
  return {path: _describe(leaf) for path, leaf in leaves_with_paths(tree, is_leaf=is_empty)}


def first_difference(saved: Layout, expected: Layout) -> str | None:
  """The first path of ``expected`` (in order) that ``saved`` lacks or has otherwise, else
  the first only ``saved`` has, else None."""
  differing = [p for p in expected if saved.get(p) != expected[p]]
  differing += [p for p in saved if p not in expected]
  return differing[0] if differing else None


def check_made_by(given: Any, made: Any, what: str, maker: str, fix: str) -> None:
  """Raises ValueError naming the first path where ``given``'s layout is not ``made``'s, the
  state ``maker`` makes, then ``fix``."""
  theirs, ours = layout(given), layout(made)
  first = first_difference(theirs, ours)
  if first is not None:
    raise ValueError(
      f"{what} is not what {maker} makes: at {first!r} it holds {theirs.get(first, 'nothing')},"
      f" not {ours.get(first, 'nothing')}. {fix}"
    )
