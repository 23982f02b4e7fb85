"""sr.interop by layer index: a list of layers, a stack and a pattern stack map onto each
other by the index ``stack.layer(i)`` takes, with a plain regex rename; a stacked source
fills a list of layers; a mismatch gives a short message with the rename that fixes it."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

D, L = 4, 6  # features and layers: tiny, to keep compile times down
X = np.asarray(jax.random.normal(jax.random.key(1), (2, D)))


class Local(sr.Module):
  def __init__(self, *, rngs):
    self.mlp = sr.nn.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.mlp(x))


class Global(Local):
  pass


class Patterned(sr.Module):
  """Ours: a pattern stack (Local, Global) of L layers at `blocks`."""

  def __init__(self, rngs):
    self.blocks = sr.remat_scan((Local, Global), length=L, lengths=(L // 2,))(rngs=rngs)


class Stacked(sr.Module):
  """Ours: a plain stack of L layers at `blocks`."""

  def __init__(self, rngs):
    self.blocks = sr.scan(Local, length=L, variable_axes={sr.Param: 0})(rngs=rngs)


class Listed(sr.Module):
  """Ours: a list of L plain layers at `blocks`."""

  def __init__(self, rngs, n=L):
    self.blocks = sr.ModuleList([Local(rngs=rngs) for _ in range(n)])


@functools.cache
def _built(cls):
  return cls(sr.Rngs(0))


def built(cls):
  return sr.clone(_built(cls))  # building a stack compiles its init once


def kernels(model) -> list[np.ndarray]:
  """Layer i's kernel, by the global index, whatever holds the layers."""
  blocks = model.blocks
  if isinstance(blocks, sr.ModuleList):
    return [np.asarray(b.mlp.kernel.value) for b in blocks]
  return [np.asarray(blocks.layer(i).mlp.kernel.value) for i in range(len(blocks))]


def assert_same_layers(a, b):
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.mlp = nnx.Linear(D, D, rngs=rngs)


class NnxLayers(nnx.Module):
  def __init__(self, rngs, n=L):
    self.layers = nnx.List([NnxBlock(rngs) for _ in range(n)])


def test_nnx_list_into_a_pattern_stack_by_global_index_and_back():
  theirs = NnxLayers(nnx.Rngs(3))
  ours = sr.interop.from_nnx(built(Patterned), theirs, rename={r"^layers\.": "blocks."})
  for i in range(L):
    np.testing.assert_array_equal(
      ours.blocks.layer(i).mlp.kernel.value, theirs.layers[i].mlp.kernel[...]
    )
    np.testing.assert_array_equal(
      ours.blocks.layer(i).mlp.bias.value, theirs.layers[i].mlp.bias[...]
    )
  fresh = NnxLayers(nnx.Rngs(9))
  sr.interop.to_nnx(ours, fresh, rename={r"^layers\.": "blocks."})
  for i in range(L):
    np.testing.assert_array_equal(fresh.layers[i].mlp.kernel[...], theirs.layers[i].mlp.kernel[...])


def test_the_old_per_position_names_still_load():
  theirs = NnxLayers(nnx.Rngs(3))

  def rename(name):
    i, rest = re.match(r"layers\.(\d+)\.(.*)", name).groups()  # type: ignore[union-attr]
    return f"blocks.pattern.{int(i) % 2}.{int(i) // 2}.{rest}"

  ours = sr.interop.from_nnx(built(Patterned), theirs, rename=rename)
  assert_same_layers(kernels(ours), [np.asarray(b.mlp.kernel[...]) for b in theirs.layers])


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(D, name="mlp")(x)), None


def linen_scanned(n):
  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=n)
      return scan(name="blocks")(x, None)[0]

  return Scanned()


@pytest.mark.parametrize("into", [Listed, Patterned])
def test_linen_stack_loads_into_a_list_and_a_pattern_stack(into):
  model = linen_scanned(L)
  variables = model.init(jax.random.key(2), X)
  stacked = np.asarray(variables["params"]["blocks"]["mlp"]["kernel"])
  assert stacked.shape == (L, D, D)
  ours = sr.interop.from_linen(built(into), variables)
  assert_same_layers(kernels(ours), list(stacked))
  if into is Listed:
    x = X
    for block in ours.blocks:
      x = block(x)
    np.testing.assert_allclose(x, model.apply(variables, X), rtol=1e-5, atol=1e-6)


def test_linen_list_round_trips_through_a_pattern_stack_by_global_index():
  ours = built(Patterned)
  variables = sr.interop.to_linen(ours, unstack=True)
  assert sorted(variables["params"]) == [f"blocks_{i}" for i in range(L)]
  back = sr.interop.from_linen(built(Patterned), variables)
  assert_same_layers(kernels(back), kernels(ours))
  for i in range(L):
    np.testing.assert_array_equal(
      variables["params"][f"blocks_{i}"]["mlp"]["kernel"], kernels(ours)[i]
    )


@pytest.mark.parametrize("source", [Listed, Stacked, Patterned])
@pytest.mark.parametrize("target", [Listed, Stacked, Patterned])
@pytest.mark.parametrize("unstack", [False, True])
def test_state_dicts_map_list_stack_and_pattern_stack_by_layer_index(source, target, unstack):
  theirs = built(source)
  flat = sr.interop.to_state_dict(theirs, unstack=unstack)
  if source is Patterned and target is not Patterned and not unstack:
    # Not built yet: a pattern stack's stacked state dict keeps one array per position
    # (`blocks.pattern.0.mlp.kernel`), which only a pattern stack of the same pattern
    # takes; elsewhere it is refused, naming what it holds.
    with pytest.raises(sr.StateMismatchError, match=r"do not map[\s\S]*blocks\.pattern\.0"):
      sr.interop.from_state_dict(built(target), flat)
    return
  ours = sr.interop.from_state_dict(built(target), flat)
  assert_same_layers(kernels(ours), kernels(theirs))


def test_a_stacked_source_with_another_layer_count_is_refused():
  variables = linen_scanned(L - 1).init(jax.random.key(2), X)
  with pytest.raises(
    sr.StateMismatchError, match=r"linen `params/blocks/mlp/kernel` \(5x4x4\) fills .* ours has 6"
  ):
    sr.interop.from_linen(built(Listed), variables)


def test_many_unmatched_names_give_a_short_message_with_the_rename():
  class Compact(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(L):
        x = LinenBlock()(x, None)[0]  # LinenBlock_0 … LinenBlock_5
      return x

  variables = Compact().init(jax.random.key(4), X)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_linen(built(Patterned), variables)
  message = str(info.value)
  assert len(message) < 1200, message
  assert message.startswith("sr.interop.from_linen: 16 variables do not map:\n")
  assert "… and 8 more." in message  # 12 linen entries, 4 shown
  assert "`blocks.pattern[0].mlp.bias` (Param)" in message  # ours
  assert "linen `params/LinenBlock_0/mlp/kernel`" in message  # theirs
  hint = re.search(r'rename=\{r"(.*?)": r"(.*?)"\} maps 12 of the 12 linen entries', message)
  assert hint is not None, message
  ours = sr.interop.from_linen(built(Patterned), variables, rename={hint[1]: hint[2]})
  expected = [np.asarray(variables["params"][f"LinenBlock_{i}"]["mlp"]["kernel"]) for i in range(L)]
  assert_same_layers(kernels(ours), expected)


def test_the_hint_maps_a_stack_under_another_name_onto_a_list():
  variables = linen_scanned(L).init(jax.random.key(2), X)
  variables = {"params": {"layers": variables["params"]["blocks"]}}
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_linen(built(Listed), variables)
  message = str(info.value)
  assert len(message) < 1000, message
  assert 'Fix: rename={r"^layers\\.": r"blocks."} maps 2 of the 2 linen entries' in message
  ours = sr.interop.from_linen(built(Listed), variables, rename={r"^layers\.": "blocks."})
  assert_same_layers(
    kernels(ours), list(np.asarray(variables["params"]["layers"]["mlp"]["kernel"]))
  )


def test_the_hint_adds_to_a_rename_given():
  with pytest.raises(
    sr.StateMismatchError,
    match=re.escape(r'add {r"^block\.(\d+)\.": r"blocks.\1."} at the end of your rename='),
  ):
    sr.interop.from_nnx(built(Patterned), NnxLayers(nnx.Rngs(0)), rename={r"^layers\.": "block."})
