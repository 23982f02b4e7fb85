"""Pickling stacks: the class forms' stacks, pattern stacks, and the layers taken out of
them (``stack.layer(i)``, an ordinary module of the layer class).

A class a class form made pickles as the call that made it (``sr.scan(Block, ...)``),
called again on load: the same class while the class form's cache holds it, an equal
one in a fresh process. Pickles name public paths only.
"""

from __future__ import annotations

import copy
import functools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests.test_layering import _pickle_names_public_paths_only

D = 4
X = jax.random.normal(jax.random.key(1), (3, D))


class Block(sr.Module):
  """carry -> carry: ``tanh(x @ w + b) * scale``."""

  def __init__(self, *, rngs, scale=1.0):
    self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / D)
    self.b = sr.Param(0.1 * jax.random.normal(rngs.params(), (D,)))
    self.scale = scale

  def __call__(self, x):
    return jnp.tanh(x @ self.w.value + self.b.value[None]) * self.scale


class Step(Block):
  """A scan body: (carry) -> (carry, y)."""

  def __call__(self, x):
    y = super().__call__(x)
    return y, y.sum()


class Noisy(sr.Module):
  """A block with live dropout: an RNG stream the layers share."""

  def __init__(self, *, rngs):
    self.w = sr.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (D,)))
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(x * self.w.value[None])


def build(kind: str):
  if kind == "scan":
    made = sr.scan(Step, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  elif kind == "remat_scan":
    made = sr.remat_scan(Block, lengths=(2, 2), policy=jax.checkpoint_policies.nothing_saveable)
  elif kind == "vmap":
    made = sr.vmap(Block, axis_size=3, in_axes=None)
  elif kind == "pattern":
    made = sr.remat_scan((Noisy, functools.partial(Block, scale=0.5)), length=5, lengths=(3,))
  else:
    raise ValueError(kind)
  return made(rngs=sr.Rngs(0, dropout=1))


KINDS = ["scan", "remat_scan", "vmap", "pattern"]


def flat_values(module):
  return {
    path: np.asarray(
      jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
    )
    for path, v in sr.state(module).flat().items()
  }


def assert_same_state(a, b):
  fa, fb = flat_values(a), flat_values(b)
  assert sorted(fa) == sorted(fb)
  for path in fa:
    np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))


def assert_same_outputs(a, b):
  """Same outputs on X; each module runs once, from its state as given."""
  for u, v in zip(jax.tree.leaves(a(X)), jax.tree.leaves(b(X)), strict=True):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("kind", KINDS)
def test_stack_pickles_as_its_class_form(kind):
  stack = build(kind)
  again = _pickle_names_public_paths_only(stack)
  assert type(again) is type(stack)
  assert_same_state(again, stack)
  assert_same_outputs(again, stack)
  assert_same_state(again, stack)  # both moved their RNG streams alike


@pytest.mark.parametrize("kind", KINDS)
def test_layer_pickles_as_an_ordinary_module(kind):
  stack = build(kind)
  layers = sr.unstack(stack)
  again = [_pickle_names_public_paths_only(layer) for layer in layers]
  for layer, twin in zip(layers, again):
    assert type(twin) is type(layer) and type(twin) in (Block, Step, Noisy)
    assert_same_state(twin, layer)
  # Each came out of the stack: sr.stack puts them back as it does the fresh layers
  # (with `like=`, a pattern's shared dropout stream differs per layer and is refused).
  for kwargs in ({}, {"like": stack}):
    try:
      fresh = sr.stack(layers, **kwargs)
    except sr.TransformError as e:
      with pytest.raises(sr.TransformError, match=re.escape(str(e).split(";")[0])):
        sr.stack(again, **kwargs)
      continue
    restacked = sr.stack(again, **kwargs)
    assert type(restacked) is type(fresh) is type(stack)
    assert_same_state(restacked, stack)
  for layer, twin in zip(layers, again):
    assert_same_outputs(twin, layer)


def test_a_layer_draws_as_in_its_stack_after_pickling():
  """One default stream serves `dropout`, unsplit while `params` splits: the layer's
  copy of the stream keeps the stack's rule (its class's), through pickle."""
  made = sr.vmap(Noisy, axis_size=3, in_axes=None, split_rngs={"params": True, "dropout": False})
  stack = made(rngs=sr.Rngs(0))
  layers = [stack.layer(i) for i in range(3)]
  again = [_pickle_names_public_paths_only(layer) for layer in layers]
  ys = stack(X)
  for i, (layer, twin) in enumerate(zip(layers, again)):
    y = twin(X)
    np.testing.assert_array_equal(y, layer(X))
    np.testing.assert_allclose(y, ys[i], rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_of_a_stack_and_of_a_layer(kind):
  stack = build(kind)
  twin = copy.deepcopy(stack)
  assert type(twin) is type(stack)
  assert_same_state(twin, stack)
  assert_same_outputs(twin, stack)
  layer = stack.layer(1)
  other = copy.deepcopy(layer)
  assert type(other) is type(layer)
  assert_same_state(other, layer)
  assert type(sr.stack([copy.deepcopy(x) for x in sr.unstack(stack)])) is type(stack)
  # A copy, not the same Variables.
  before = flat_values(stack)
  for _, variable in twin.iter_variables():
    variable.value = jnp.zeros_like(variable.value) if variable.shape else variable.value
  for path, value in flat_values(stack).items():
    np.testing.assert_array_equal(value, before[path], err_msg=str(path))


def test_the_class_itself_pickles():
  made = sr.vmap(Block, axis_size=3, in_axes=None)
  assert pickle.loads(pickle.dumps(made)) is made
  pattern = sr.scan((Block, Step), length=4, variable_axes={sr.Param: 0})
  assert pickle.loads(pickle.dumps(pattern)) is pattern
  for position in sr.remat_scan((Noisy, Block), length=3, lengths=(2,))(rngs=sr.Rngs(0)).pattern:
    assert pickle.loads(pickle.dumps(type(position))) is type(position)


def test_a_fresh_process_makes_the_classes_again(tmp_path):
  stacks = {kind: build(kind) for kind in KINDS}
  path = tmp_path / "stacks.pkl"
  path.write_bytes(pickle.dumps(stacks))
  expected = {kind: [np.asarray(y) for y in jax.tree.leaves(s(X))] for kind, s in stacks.items()}
  (tmp_path / "expected.pkl").write_bytes(pickle.dumps(expected))
  root = Path(__file__).resolve().parent.parent
  script = f"""
import pickle, sys
sys.path[:0] = [{str(root)!r}, {str(root / "tests")!r}]
import jax, numpy as np
import test_pickle_stacks as t
stacks = pickle.loads(open({str(path)!r}, "rb").read())
expected = pickle.loads(open({str(tmp_path / "expected.pkl")!r}, "rb").read())
for kind, stack in stacks.items():
  assert type(stack).__qualname__ == type(t.build(kind)).__qualname__, kind
  assert type(stack) is type(t.build(kind)), kind
  for y, e in zip(jax.tree.leaves(stack(t.X)), expected[kind], strict=True):
    np.testing.assert_allclose(np.asarray(y), e, rtol=1e-6, atol=1e-6)
print("loaded", sorted(stacks))
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "loaded ['pattern', 'remat_scan', 'scan', 'vmap']" in done.stdout


def test_refuses_a_class_form_argument_pickle_cannot_find():
  stack = sr.remat_scan(Block, lengths=(2,), policy=lambda *a, **k: False)(rngs=sr.Rngs(0))
  with pytest.raises(
    pickle.PicklingError,
    match=r"cannot pickle RematScanBlock: .*sr\.remat_scan\(Block, \.\.\.\).*argument "
    r"`policy=` \(.*<locals>\.<lambda>\) cannot be pickled.*Fix: .*top level of a module"
    r".*sr\.save",
  ):
    pickle.dumps(stack)


def test_refuses_a_class_defined_in_a_function():
  class Local(Block):
    pass

  stack = sr.vmap(Local, axis_size=2, in_axes=None)(rngs=sr.Rngs(0))
  with pytest.raises(
    pickle.PicklingError,
    match=r"cannot pickle VmapLocal: .*sr\.vmap\(Local, \.\.\.\).*its class \(.*<locals>\.Local\) "
    r"cannot be pickled.*Fix: ",
  ):
    pickle.dumps(stack)
  # Copies need no name: deepcopy still works.
  assert type(copy.deepcopy(stack)) is type(stack)
