"""The zoo's oracle and checks, written independently of the library's pair resolution.

A declaration (a ``saggs.Pair``, possibly naming ``saggs.Block`` parts of leaves) is resolved
here, in NumPy, into *atoms*: one atom per independent factor, listing every entry of every
leaf it scales, with its sign (side a: ``c``, side b: ``1/c``) and its role (a member, whose
norm counts, or a follower). Atoms do not depend on how a declaration is spelled (pattern
suffixes, ``stacked``, ``groups=1`` or ``axes=None``, which side is a), so the found and the
hand-written sets are compared as sets of atoms. The orbit moves and the norms of the checks
are computed from atoms alone.

Each ``check_*`` takes a :class:`Zoo` and a scratch directory and raises ``AssertionError``
with what it measured; the test files and the gemma worker (``gemma_worker.py``, a
subprocess) run the same checks.
"""

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import saggs_jax as saggs

EXACT = 1e-5  # largest logit change under an exact orbit move, relative to max |logits|
BROKEN = 1e-3  # smallest logit change that shows a declaration is not a symmetry
BALANCED = 1e-4  # largest |log(||A_g|| / ||B_g||)| after hard balancing


class Zoo(NamedTuple):
  """A model of the zoo with what discover found on it and what the architecture has."""

  name: str
  apply: Callable[..., Any]  # apply(params, *inputs) -> logits, jitted
  params: Any
  inputs: tuple
  found: Any  # saggs.discover's Discovery, or the exception it raised
  seconds: float  # discover's wall time
  # hand-written, as functions (some name saggs.Block): the symmetries the architecture has,
  # and declarations that look alike but are no symmetry (a GELU MLP, (1 + w) norm gains)
  expected: Callable[[], list]
  not_symmetries: Callable[[], list]
  untouched: tuple = ()  # patterns of leaves no found pair may scale ((1+w) gains)


# ---------------------------------------------------------------------------
# Paths and patterns, as the README specifies them.


def path_str(keypath) -> str:
  parts = []
  for k in keypath:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  if parts and parts[-1] == "value":
    parts.pop()
  return "/".join(parts)


def leaves(params) -> dict[str, np.ndarray]:
  """Floating array leaves by path, in float64."""
  out = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      out[path_str(kp)] = np.asarray(x, np.float64)
  return out


def rebuild(params, values: dict[str, np.ndarray]):
  def put(kp, x):
    path = path_str(kp)
    return jnp.asarray(values[path], x.dtype) if path in values else x

  return jax.tree_util.tree_map_with_path(put, params)


def _match_segments(pat: list[str], segs: list[str]):
  """Captures of ``pat`` matching all of ``segs``: each wildcard segment's text, or None."""
  if not pat:
    return () if not segs else None
  head, rest = pat[0], pat[1:]
  if head == "**":
    for n in range(len(segs) + 1):
      tail = _match_segments(rest, segs[n:])
      if tail is not None:
        return ("/".join(segs[:n]), *tail)
    return None
  if not segs or not fnmatch.fnmatchcase(segs[0], head):
    return None
  tail = _match_segments(rest, segs[1:])
  if tail is None:
    return None
  return ((segs[0],) if any(ch in head for ch in "*?[") else ()) + tail


def match(pattern: str, path: str):
  """The captures of ``pattern`` on ``path`` (anchored at the end; the unmatched leading
  segments are the first capture), or None."""
  segs = path.split("/")
  for start in range(len(segs) + 1):
    caps = _match_segments(pattern.split("/"), segs[start:])
    if caps is not None:
      return ("/".join(segs[:start]), *caps)
  return None


# ---------------------------------------------------------------------------
# Declarations -> atoms.


class Atom(NamedTuple):
  members: tuple  # (path, role, sign, flat indices) with role "m" (member) or "f" (follower)


def _block_slice(spec, shape, stacked):
  """The index tuple of ``spec``'s block in a leaf of ``shape`` (everything for a plain pattern)."""
  if isinstance(spec, str):
    return tuple(slice(None) for _ in shape)
  axis = spec.axis + stacked if spec.axis >= 0 else len(shape) + spec.axis
  names = spec.parts if isinstance(spec.parts, tuple) else tuple(range(spec.parts))
  sizes = spec.sizes or (shape[axis] // len(names),) * len(names)
  assert sum(sizes) == shape[axis], (spec, shape)
  k = names.index(spec.part) if spec.part in names else spec.part
  start = sum(sizes[:k])
  return tuple(
    slice(start, start + sizes[k]) if i == axis else slice(None) for i in range(len(shape))
  )


def _pattern(spec) -> str:
  return spec if isinstance(spec, str) else spec.pattern


def _tuple(x):
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def atoms(pairs, values: dict[str, np.ndarray]) -> list[Atom]:
  """Every atom of every instance of ``pairs`` on the leaves ``values``."""
  out = []
  for pair in pairs:
    axes = pair.axes if pair.axes is not None else (None, None)
    sides = []
    for sign, side, ax, follow in (
      (1, pair.a, axes[0], pair.follow_a),
      (-1, pair.b, axes[1], pair.follow_b),
    ):
      specs = _tuple(side)
      ax = ax if isinstance(ax, tuple) else (ax,) * len(specs)
      sides += [(sign, "m", spec, a) for spec, a in zip(specs, ax)]
      sides += [(sign, "f", spec, None) for spec in _tuple(follow)]
    instances: dict[tuple, list] = {}
    for k, (_, _, spec, _) in enumerate(sides):
      for path in values:
        caps = match(_pattern(spec), path)
        if caps is not None:
          instances.setdefault(caps, {})[k] = path
    for caps, paths in instances.items():
      assert len(paths) == len(sides), (pair, caps, paths)
      members = [(*sides[k], paths[k]) for k in range(len(sides))]
      out += _instance_atoms(pair, members, values)
  return out


def _copy_first(stacked, ndim) -> tuple[int, ...]:
  """The axis order that puts a leaf's copy axes first: ``stacked`` leading axes (an int) or
  the positions it names (a tuple), in order, then the others."""
  copy = tuple(range(stacked)) if isinstance(stacked, int) else tuple(stacked)
  return copy + tuple(i for i in range(ndim) if i not in copy)


def _instance_atoms(pair, members, values):
  """The atoms of one instance. Each leaf is viewed with its copy axes first (so that blocks,
  group axes and copies count as for leading copy axes) and its ids put back in its own order."""
  s = pair.stacked if isinstance(pair.stacked, int) else len(pair.stacked)
  regions, group_axis, orders = [], {}, {}
  for sign, role, spec, ax, path in members:
    order = orders[path] = _copy_first(pair.stacked, values[path].ndim)
    index = _block_slice(spec, values[path].transpose(order).shape, s)
    shape = values[path].transpose(order)[index].shape
    if role == "m":
      gax = None if ax is None else (s + ax if ax >= 0 else len(shape) + ax)
      group_axis.setdefault(sign, (gax, shape))
    else:  # a follower: its kernel's group axis counted from the end, else a bias's only axis
      kax, kshape = group_axis[sign]
      gax = None if kax is None else kax - (len(kshape) - len(shape))
      if kax is not None and (gax < s or shape[gax] != kshape[kax]):
        assert len(shape) == s + 1 and shape[s] == kshape[kax], (pair, path, shape, kshape)
        gax = s
    regions.append((sign, role, path, index, shape, gax))
  gax0, shape0 = group_axis[1]
  groups = 1 if gax0 is None else (pair.groups or shape0[gax0])
  copies = int(np.prod(shape0[:s], dtype=int))
  ids_per_member = []
  for sign, role, path, index, shape, gax in regions:
    copy = np.arange(copies).reshape(shape[:s] + (1,) * (len(shape) - s))
    if gax is None:
      group = np.zeros((1,) * len(shape), int)
    else:
      group = (np.arange(shape[gax]) // (shape[gax] // groups)).reshape(
        (1,) * gax + (-1,) + (1,) * (len(shape) - gax - 1)
      )
    full = np.full(values[path].transpose(orders[path]).shape, -1)
    full[index] = np.broadcast_to(copy * groups + group, shape)
    full = full.transpose(np.argsort(orders[path]))
    ids_per_member.append((path, role, sign, full.ravel()))
  result = []
  for atom_id in range(copies * groups):
    result.append(
      Atom(
        tuple(
          (path, role, sign, np.flatnonzero(ids == atom_id))
          for path, role, sign, ids in ids_per_member
        )
      )
    )
  return result


def key(atom: Atom):
  """What an atom scales, independent of spelling and of which side is called a."""
  members = sorted(
    (path, role, sign, tuple(idx.tolist())) for path, role, sign, idx in atom.members
  )
  flip = members[0][2]
  return frozenset((path, role, sign * flip, idx) for path, role, sign, idx in members)


def describe_atom(atom: Atom) -> str:
  return ", ".join(
    f"{'+' if sign > 0 else '-'}{path}[{len(idx)}]{'(f)' if role == 'f' else ''}"
    for path, role, sign, idx in atom.members
  )


def orbit_move(values, atom_list, factors):
  """``values`` with atom i scaled by ``factors[i]`` on its side a and by its inverse on b."""
  out = {path: x.copy() for path, x in values.items()}
  for atom, c in zip(atom_list, factors):
    for path, _, sign, idx in atom.members:
      flat = out[path].reshape(-1)
      flat[idx] *= c**sign
  return out


def log_imbalance(values, atom_list) -> np.ndarray:
  """``log(||A|| / ||B||)`` per atom, over its members (not its followers), in float64."""
  result = []
  for atom in atom_list:
    sq = {1: 0.0, -1: 0.0}
    for path, role, sign, idx in atom.members:
      if role == "m":
        sq[sign] += float(np.sum(values[path].reshape(-1)[idx] ** 2))
    result.append(0.5 * np.log(sq[1] / sq[-1]))
  return np.array(result)


# ---------------------------------------------------------------------------
# The checks.


def found(zoo: Zoo):
  if isinstance(zoo.found, Exception):
    raise AssertionError(f"{zoo.name}: discover raised {zoo.found!r}") from zoo.found
  return zoo.found


def logits(zoo: Zoo, params) -> np.ndarray:
  with jax.default_matmul_precision("highest"):
    return np.asarray(zoo.apply(params, *zoo.inputs), np.float64)


def deviation(zoo: Zoo, params) -> float:
  y0, y1 = logits(zoo, zoo.params), logits(zoo, params)
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def random_move(zoo: Zoo, pairs, seed=0, spread=1.5):
  values = leaves(zoo.params)
  atom_list = atoms(pairs, values)
  factors = np.exp(np.random.default_rng(seed).uniform(-spread, spread, len(atom_list)))
  return rebuild(zoo.params, orbit_move(values, atom_list, factors))


def check_found_pairs_are_exact(zoo: Zoo, tmp_dir=None):
  assert len(found(zoo)) > 0, f"{zoo.name}: discover found nothing"
  for seed in (0, 1):
    dev = deviation(zoo, random_move(zoo, found(zoo), seed))
    assert dev < EXACT, (
      f"{zoo.name}: random factors on the found pairs change the logits by {dev:.2e}"
    )


def check_expected_symmetries_are_found(zoo: Zoo, tmp_dir=None):
  values = leaves(zoo.params)
  keys = {key(a) for a in atoms(found(zoo), values)}
  missing = []
  for pair in zoo.expected():
    lost = [a for a in atoms([pair], values) if key(a) not in keys]
    if lost:
      missing.append(f"{pair!r}: {len(lost)} atoms, e.g. {describe_atom(lost[0])}")
  assert not missing, (
    f"{zoo.name}: not found:\n  " + "\n  ".join(missing) + f"\ndiscover found:\n{found(zoo)!r}"
  )


def check_expected_list_is_exact(zoo: Zoo, tmp_dir=None):
  """The hand-written lists themselves: exact, and their counterexamples are not."""
  dev = deviation(zoo, random_move(zoo, zoo.expected(), seed=2))
  assert dev < EXACT, f"{zoo.name}: the expected list moves the logits by {dev:.2e}"
  for pair in zoo.not_symmetries():
    dev = deviation(zoo, random_move(zoo, [pair], seed=3))
    assert dev > BROKEN, f"{zoo.name}: {pair!r} is a symmetry after all ({dev:.2e})"


def check_no_wrong_pair_is_found(zoo: Zoo, tmp_dir=None):
  values = leaves(zoo.params)
  keys = {key(a) for a in atoms(found(zoo), values)}
  for pair in zoo.not_symmetries():
    wrong = [a for a in atoms([pair], values) if key(a) in keys]
    assert not wrong, f"{zoo.name}: found {describe_atom(wrong[0])}, which is no symmetry"
  touched = sorted(
    {
      path
      for a in atoms(found(zoo), values)
      for path, *_ in a.members
      if any(match(pattern, path) for pattern in zoo.untouched)
    }
  )
  assert not touched, f"{zoo.name}: found pairs scale {touched}"


def _imbalanced(zoo: Zoo, factor=8.0):
  values = leaves(zoo.params)
  atom_list = atoms(found(zoo), values)
  assert atom_list, f"{zoo.name}: discover found nothing to balance"
  moved = orbit_move(values, atom_list, np.full(len(atom_list), factor))
  return rebuild(zoo.params, moved), atom_list


def check_one_hard_update_balances(zoo: Zoo, tmp_dir=None):
  params, atom_list = _imbalanced(zoo)
  before = np.max(np.abs(log_imbalance(leaves(params), atom_list)))
  assert before > 1.0, f"{zoo.name}: the 8x move left the norms balanced ({before:.2e})"
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(found(zoo)))
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  after = np.abs(log_imbalance(leaves(new), atom_list))
  worst = int(np.argmax(after))
  assert after[worst] < BALANCED, (
    f"{zoo.name}: after one hard update |log(||A||/||B||)| = "
    f"{after[worst]:.2e} on {describe_atom(atom_list[worst])}"
  )
  dev = deviation(zoo, new)
  assert dev < EXACT, f"{zoo.name}: balancing changed the logits by {dev:.2e}"


def check_canonicalize_keeps_logits(zoo: Zoo, tmp_dir=None):
  params, atom_list = _imbalanced(zoo)
  state = optax.adam(1e-3).init(params)
  canon, _ = saggs.canonicalize(params, state, found(zoo))
  dev = deviation(zoo, canon)
  assert dev < EXACT, f"{zoo.name}: canonicalize changed the logits by {dev:.2e}"
  after = np.max(np.abs(log_imbalance(leaves(canon), atom_list)))
  assert after < BALANCED, f"{zoo.name}: canonicalize left |log(||A||/||B||)| = {after:.2e}"


def check_check_symmetry(zoo: Zoo, tmp_dir=None):
  with jax.default_matmul_precision("highest"), warnings.catch_warnings():
    # Exactness is what this asserts; a pair that is exact but moot (Gemma 3's sandwich norms
    # hide each side of its MLP on its own) is reported by a MootPairWarning, not an error.
    warnings.simplefilter("ignore", saggs.MootPairWarning)
    saggs.check_symmetry(zoo.apply, zoo.params, list(found(zoo)), *zoo.inputs)
    for pair in zoo.not_symmetries():
      try:
        saggs.check_symmetry(zoo.apply, zoo.params, [pair], *zoo.inputs)
      except ValueError:
        continue
      raise AssertionError(f"{zoo.name}: check_symmetry accepted {pair!r}")


def check_checkpoint_round_trip(zoo: Zoo, tmp_dir):
  import orbax.checkpoint as ocp

  params, atom_list = _imbalanced(zoo)
  tx = saggs.chain(optax.adam(1e-3), saggs.saggs(found(zoo)))
  state = tx.init(params)
  manager = ocp.CheckpointManager(str(tmp_dir) + "/ckpt")
  assert saggs.checkpoint.save(manager, 3, params, state)
  manager.wait_until_finished()
  target = (zoo.params, tx.init(zoo.params))
  raw, raw_state, step = saggs.checkpoint.restore(manager, *target, canonicalize=False)
  assert step == 3
  for got, want in zip(jax.tree.leaves((raw, raw_state)), jax.tree.leaves((params, state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  canon, _, _ = saggs.checkpoint.restore(manager, *target, pairs=found(zoo), tx=tx)
  dev = deviation(zoo, canon)
  assert dev < EXACT, f"{zoo.name}: the restored state's logits differ by {dev:.2e}"
  after = np.max(np.abs(log_imbalance(leaves(canon), atom_list)))
  assert after < BALANCED, f"{zoo.name}: the restored state is not canonical ({after:.2e})"
  manager.close()


CHECKS = {name[len("check_") :]: f for name, f in globals().items() if name.startswith("check_")}
