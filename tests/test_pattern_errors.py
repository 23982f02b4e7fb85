"""Stacks of a repeating pattern given bad input: each error names the position in the
pattern and its class, says the fix, and builds or changes nothing (the Rngs' counts,
the stack's values)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

D = 4
SCAN = dict(variable_axes={True: 0}, split_rngs={True: True})


class Local(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x))


class Global(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return x - jnp.tanh(self.linear(x))


class Narrow(sr.Module):
  """Returns a carry of another shape than it was given."""

  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)[..., :2]


class Half(sr.Module):
  """Returns a carry of another dtype than it was given."""

  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return self.linear(x).astype(jnp.float16)


class Broken(sr.Module):
  """Builds its Linear (drawing from the Rngs), then fails."""

  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    raise ValueError("Broken cannot be built")


def counts(rngs):
  return {path: int(v) for path, v in sr.state(rngs).flat().items() if path[-1] == "count"}


def values(module):
  return {
    path: np.asarray(v)
    for path, v in sr.state(module).flat().items()
    if not jnp.issubdtype(jnp.asarray(v).dtype, jax.dtypes.prng_key)
  }


def assert_unchanged(module, before):
  after = values(module)
  assert after.keys() == before.keys()
  for path in before:
    np.testing.assert_array_equal(after[path], before[path])


# -- the pattern itself -------------------------------------------------------------


@pytest.mark.parametrize(
  "element, named",
  [
    (3, r"int 3"),
    (jnp.tanh, r"the function tanh"),
    (functools.partial(jnp.add, 1), r"partial functools\.partial\(.*\)"),
    (Local(D, rngs=sr.Rngs(0)), r"a Local instance"),
  ],
  ids=["int", "function", "partial-of-a-function", "instance"],
)
@pytest.mark.parametrize("transform", ["scan", "remat_scan", "vmap"])
def test_an_element_that_is_not_a_module_class_names_its_position(transform, element, named):
  make = {
    "scan": lambda p: sr.scan(p, length=4, **SCAN),
    "remat_scan": lambda p: sr.remat_scan(p, length=4, lengths=(2,)),
    "vmap": lambda p: sr.vmap(p, axis_size=4),
  }[transform]
  with pytest.raises(
    sr.TransformError,
    match=(
      rf"sr\.{transform}\(\(Local, [^\n]*\)\): position 1 of the pattern is {named}, not a "
      r"Module class\. Every element of a pattern is a Module class or a "
      r"`functools\.partial` of one, e\.g\. .* Nothing was built\."
    ),
  ):
    make((Local, element))


class Windowed(sr.Module):
  def __init__(self, dim, *, window=1, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.window = window


def test_a_partial_of_a_module_class_is_fine_and_an_empty_pattern_is_not():
  stack = sr.scan((Windowed, functools.partial(Windowed, window=3)), length=3, **SCAN)(
    D, rngs=sr.Rngs(0)
  )
  assert [stack.layer(i).window for i in range(3)] == [1, 3, 1]
  with pytest.raises(
    sr.TransformError,
    match=r"the pattern is empty\. Give a tuple of "
    r"Module classes",
  ):
    sr.scan((), length=3)


@pytest.mark.parametrize("length", [2, 0, -1, True, 2.5])
def test_a_length_shorter_than_the_pattern_is_refused(length):
  with pytest.raises(
    sr.TransformError,
    match=(
      rf"sr\.scan\(\(Local, Local, Global\)\): length={length!r} is shorter than the "
      r"pattern of 3 blocks, so some position would hold no layer\. Fix: length >= 3 "
      r"\(any length: the last cycle may be short\)"
    ),
  ):
    sr.scan((Local, Local, Global), length=length, **SCAN)


@pytest.mark.parametrize(
  "make, named",
  [
    (lambda: sr.scan((Local, Global), **SCAN), r"sr\.scan\(\(Local, Global\)\)"),
    (lambda: sr.vmap((Local, Global)), r"sr\.vmap\(\(Local, Global\)\)"),
    (
      lambda: sr.remat_scan((Local, Global), lengths="auto"),
      r"sr\.remat_scan\(\(Local, Global\)\)",
    ),
    (
      lambda: sr.remat_scan((Local, Global), lengths=(2, 2)),
      r"sr\.remat_scan\(\(Local, Global\)\)",
    ),
  ],
)
def test_a_missing_length_is_refused(make, named):
  with pytest.raises(
    sr.TransformError,
    match=(
      rf"{named}: a pattern stack needs `length=` \(the number of layers; `axis_size=` "
      r"for sr\.vmap\), so that each of the 2 positions knows how many layers it holds"
    ),
  ):
    make()


@pytest.mark.parametrize(
  "length, lengths, fix",
  [
    (10, (2, 2), r"lengths=\(3, 2\)"),  # 5 cycles needed, 4 given
    (9, (4,), r"lengths=\(5,\)"),  # the short last cycle counts too
  ],
)
def test_lengths_covering_fewer_cycles_than_length_needs(length, lengths, fix):
  with pytest.raises(
    sr.TransformError,
    match=(
      rf"sr\.remat_scan\(\(Local, Global\)\): for a pattern of 2 blocks, lengths counts "
      rf"cycles, and lengths={re.escape(str(lengths))} covers \d cycles, fewer than the \d "
      rf"that "
      rf"length={length} needs .* Fix: {fix}, or lengths='auto'\."
    ),
  ):
    sr.remat_scan((Local, Global), length=length, lengths=lengths)


# -- building -------------------------------------------------------------------------


def test_a_failed_build_at_a_later_position_leaves_the_rngs_as_they_were():
  rngs = sr.Rngs(0, dropout=1)
  before = counts(rngs)
  Stack = sr.scan((Local, Local, Broken), length=5, **SCAN)
  with pytest.raises(ValueError, match="Broken cannot be built") as caught:
    Stack(D, rngs=rngs)
  # Positions 0 and 1 were built (each drew from `params`) before position 2 failed.
  assert counts(rngs) == before
  assert any(
    "position 2 of its pattern, Broken; nothing was built" in note
    for note in caught.value.__notes__
  )
  # And the next build draws what it would have drawn without the failure.
  good = sr.scan((Local, Local, Global), length=5, **SCAN)(D, rngs=rngs)
  fresh = sr.scan((Local, Local, Global), length=5, **SCAN)(D, rngs=sr.Rngs(0, dropout=1))
  np.testing.assert_array_equal(
    good.pattern[1].linear.kernel.value, fresh.pattern[1].linear.kernel.value
  )


def test_init_in_axes_of_the_wrong_size_names_the_argument_and_builds_nothing():
  rngs = sr.Rngs(0)
  before = counts(rngs)

  class Scaled(sr.Module):
    def __init__(self, scale, *, rngs):
      self.scale = sr.Param(scale * jnp.ones((D,)))

  Stack = sr.scan((Scaled, Scaled), length=5, init_in_axes=(0,), **SCAN)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"init_in_axes maps constructor argument 0 along axis 0, one slice per layer, so it "
      r"needs 5 entries there; it has shape \(4,\)\. Fix: give it 5 entries at axis 0"
    ),
  ):
    Stack(jnp.arange(4.0), rngs=rngs)
  assert counts(rngs) == before
  stack = Stack(jnp.arange(5.0), rngs=rngs)
  assert [float(stack.layer(i).scale.value[0]) for i in range(5)] == [0, 1, 2, 3, 4]


# -- running --------------------------------------------------------------------------


@pytest.mark.parametrize("other, got", [(Narrow, r"float32\[2\]"), (Half, r"float16\[4\]")])
def test_blocks_whose_carries_differ_name_the_position_and_class(other, got):
  stack = sr.remat_scan((Local, Local, other), length=6, lengths=(2,))(D, rngs=sr.Rngs(0))
  before = values(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      rf"position 2 of the pattern \({other.__name__}\).*{got}.* Every block of a pattern "
      r"takes and returns the same carry: the blocks' carries must agree in structure, "
      r"shape and dtype\."
    ),
  ):
    stack(jnp.ones((D,)))
  assert_unchanged(stack, before)


class Ys(sr.Module):
  def __init__(self, dim, *, rngs):
    self.w = sr.Param(jnp.ones((dim,)))

  def __call__(self, c, x):
    return c + x, c * self.w.value


class ShortYs(Ys):
  def __call__(self, c, x):
    return c - x, (c * self.w.value)[:2]


def test_blocks_whose_ys_differ_in_sr_scan_name_both_positions():
  stack = sr.scan((Ys, ShortYs), length=4, **SCAN)(D, rngs=sr.Rngs(0))
  before = values(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"the blocks' ys differ: position 0 \(Ys\) gives float32\[4\] and position 1 "
      r"\(ShortYs\) gives float32\[2\]\. The ys of a pattern stack are stacked over its "
      r"layers in order, so every block must return ys of one structure, shape and dtype"
    ),
  ):
    stack(jnp.zeros((D,)), jnp.ones((4, D)))
  assert_unchanged(stack, before)


def test_pattern_index_out_of_range_lists_the_positions():
  stack = sr.scan((Local, functools.partial(Global)), length=5, **SCAN)(D, rngs=sr.Rngs(0))
  assert stack.pattern[-1] is stack.pattern[1]
  for k in (2, -3, "1"):
    with pytest.raises(
      IndexError,
      match=(
        rf"stack\.pattern\[{k!r}\]: the pattern has 2 positions \(Local, "
        r"partial\(Global, \)\); use 0\.\.1 \(or -2\.\.-1\)\. Layer i of the stack is "
        r"`stack\.layer\(i\)`, at position i % 2\."
      ),
    ):
      stack.pattern[k]


def test_numpy_and_jax_integers_index_a_pattern_stack_as_python_ints_do():
  stack = sr.scan((Local, Global), length=5, **SCAN)(D, rngs=sr.Rngs(0))
  for i in (np.int64(3), np.int32(-2), jnp.int32(3)):
    assert stack.pattern[i % 2] is stack.pattern[int(i) % 2]
    layer, expected = stack.layer(i), stack.layer(int(i))
    assert type(layer) is type(expected)
    ours, theirs = sr.state(layer, sr.Param).flat(), sr.state(expected, sr.Param).flat()
    assert ours.keys() == theirs.keys()
    for path, value in theirs.items():
      np.testing.assert_array_equal(ours[path], value)
  with pytest.raises(IndexError, match=r"layer np\.int64\(5\) of a pattern stack of 5"):
    stack.layer(np.int64(5))
  with pytest.raises(IndexError, match=r"layer 1\.0 of a pattern stack"):
    stack.layer(1.0)


def test_sr_stack_of_layers_out_of_pattern_order_names_the_layer_and_position():
  stack = sr.scan((Local, Global), length=4, **SCAN)(D, rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.stack: layer 0 is a Global, but layer 0 of this pattern \(position 0\) is a "
      r"Local\. Fix: put the layers in pattern order \(as `sr\.unstack` gives them\)\."
    ),
  ):
    sr.stack([layers[1], layers[0], *layers[2:]])
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.stack: 1 layers for a pattern of 2 blocks; every position needs at least one "
      r"layer\. Fix: give at least 2 layers"
    ),
  ):
    sr.stack(layers[:1], like=stack)
  again = sr.stack(layers)
  np.testing.assert_array_equal(
    again.pattern[1].linear.kernel.value, stack.pattern[1].linear.kernel.value
  )


def test_sr_stack_of_a_patterns_layers_names_the_layer_as_the_user_numbered_it():
  stack = sr.remat_scan((Local, Global), length=6, lengths=(3,))(D, rngs=sr.Rngs(0))
  layers = [stack.layer(i) for i in range(6)]
  layers[4].linear.kernel.value = jnp.zeros((D, D + 1))
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.stack: `linear\.kernel` of layer 4 does not have the shape and dtype of layer "
      r"0's \(position 0 of the pattern stacks layers 0, 2, 4\): float32\[4, 4\] \(layer "
      r"0\) vs float32\[4, 5\] \(layer 4\)"
    ),
  ):
    sr.stack(layers, like=stack)
  layers = [stack.layer(i) for i in range(6)]
  layers[5].linear.bias.value = layers[5].linear.bias.value.astype(jnp.float16)
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.bias` of layer 5 .* of layer 1's \(position 1 of the pattern stacks "
    r"layers 1, 3, 5\): float32\[4\] \(layer 1\) vs float16\[4\] \(layer 5\)",
  ):
    sr.stack(layers, like=stack)


def test_sr_stack_of_a_patterns_layers_names_the_layer_holding_another_shared_value():
  class Norm(sr.Module):
    def __init__(self, dim, *, rngs):
      self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
      self.bn = sr.nn.BatchNorm(dim, rngs=rngs)

    def __call__(self, x):
      return self.bn(self.linear(x))

  stack = sr.scan((Norm, Local), length=6, variable_axes={sr.Param: 0})(D, rngs=sr.Rngs(0))
  layers = [stack.layer(i) for i in range(6)]
  layers[4].bn.mean.value = layers[4].bn.mean.value + 1.0
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`bn\.mean` \(BatchStat\) is not stacked .* but layer 4's differs from layer 0's "
      r"\(position 0 of the pattern stacks layers 0, 2, 4\).*"
      r"`NewClass = sr\.scan\(\(Norm, Local\), \.\.\., variable_axes=\{sr\.BatchStat: 0\}\)`"
    ),
  ):
    sr.stack(layers, like=stack)


class Normed(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.bn = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.linear(x)), None


class Other(Normed):
  pass


def test_a_pattern_scans_messages_name_variables_as_the_user_reaches_them():
  stack = sr.scan((Normed, Other), length=4, variable_axes={sr.Param: 0})(D, rngs=sr.Rngs(0))
  before = values(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"the body wrote to `pattern\[0\]\.bn\.mean` \(BatchStat, collection "
      r"'batch_stats'\), which is matched by no collection rule.*Fix: carry it"
    ),
  ):
    stack(jnp.ones((3, D)))
  assert_unchanged(stack, before)
  assert stack.pattern[0].bn.mean.shape == (D,)  # the path the message gave
  # A function-form scan over a pattern stack whose stacked stats its rules do not slice.
  stack = sr.remat_scan((Normed, Other), length=4, lengths=(2,))(D, rngs=sr.Rngs(0))
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`pattern\[0\]\.bn\.mean` \(BatchStat\) of the pattern stack's position 0, a "
      r"stacked RematScanNormed, carries the layer axis \(axis 0, 2 layers\)"
    ),
  ):
    sr.remat_scan(lambda m, c: m(c)[0], lengths=(2,), variable_axes={sr.Param: 0})(
      stack, jnp.ones((3, D))
    )
  # Both variable_broadcast and variable_carry: the rules' own message names it so too.
  with pytest.raises(
    sr.TransformError, match=r"`pattern\[0\]\.bn\.mean` \(BatchStat\) is matched by both"
  ):
    sr.scan(
      lambda m, c: (m(c)[0], None),
      variable_axes={sr.Param: 0},
      variable_broadcast="batch_stats",
      variable_carry="batch_stats",
    )(stack, jnp.ones((3, D)))


def test_a_pattern_stack_with_edited_positions_is_refused_before_running():
  Stack = sr.remat_scan((Local, Global), length=4, lengths=(2,))
  stack, longer = (
    Stack(D, rngs=sr.Rngs(0)),
    sr.remat_scan((Local, Global), length=6, lengths=(3,))(D, rngs=sr.Rngs(1)),
  )
  stack.pattern = (stack.pattern[0], longer.pattern[1])  # 2 Local, 3 Global
  before = values(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"the positions of the pattern stack hold \[2, 3\] layers; a pattern of 2 over 5 "
      r"layers holds \[3, 2\] \(layer i at position i % 2\)\. Fix: rebuild the stack"
    ),
  ):
    stack(jnp.ones((D,)))
  assert_unchanged(stack, before)
  stack.pattern = (stack.pattern[0], longer.pattern[1].layer(0))
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`pattern\.1` of the pattern stack is a Global, not a stack\. Build pattern stacks "
      r"with a class form"
    ),
  ):
    stack(jnp.ones((D,)))


def test_indexing_a_stack_or_reaching_into_a_pattern_stack_points_to_the_way():
  class Attn(sr.Module):
    def __init__(self, *, rngs):
      self.attn = sr.nn.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
      return self.attn(x)

  class Scale(sr.Module):
    def __init__(self, *, rngs):
      self.w = sr.Param(jnp.ones((2,)))

    def __call__(self, x):
      return x * self.w.value

  stack = sr.remat_scan(sr.nn.Linear, lengths=(3,))(2, 2, rngs=sr.Rngs(0))
  with pytest.raises(
    TypeError, match=r"not subscriptable: layer 2 of the stack is `stack\.layer\(2\)`"
  ):
    stack[2]
  pattern = sr.remat_scan((Attn, Scale), lengths=(2,), length=4)(rngs=sr.Rngs(0))
  with pytest.raises(
    AttributeError,
    match=r"no attribute 'attn': a pattern stack holds its layers by position.*position 0 of 2 "
    r"has it: `stack\.pattern\[0\]\.attn`",
  ):
    pattern.attn
  with pytest.raises(AttributeError, match=r"no attribute 'nope'.*no position has it either"):
    pattern.nope
  with pytest.raises(TypeError, match=r"`stack\.layer\(1\)`.*`stack\.pattern\[k\]`"):
    pattern[1]
  assert not hasattr(pattern, "_private") and getattr(pattern, "attn", None) is None
  assert pattern.pattern[0].attn.kernel.shape == (2, 2, 2)


def test_a_scan_baseline_of_a_remat_scan_pattern_takes_one_fix_per_step():
  # Issue 34, item 17: a no-remat baseline of a remat_scan pattern stack. Each refusal
  # says the whole way: the class form's default variable_axes, then the block's
  # return, where remat_scan with everything saved is the same block without remat.
  with pytest.raises(
    sr.TransformError, match=r"here `linear.bias`, `linear.kernel`\).*`variable_axes=\{True: 0\}`"
  ):
    sr.scan((Local, Global), length=4)(D, rngs=sr.Rngs(0))
  stack = sr.scan((Local, Global), length=4, variable_axes={True: 0})(D, rngs=sr.Rngs(0))
  with pytest.raises(TypeError, match=r"everything_saveable\), which keeps every residual"):
    stack(jnp.ones((2, D)))
  saved = jax.checkpoint_policies.everything_saveable
  kept = sr.remat_scan((Local, Global), length=4, lengths=(2,), policy=saved)(D, rngs=sr.Rngs(0))
  x = jnp.ones((2, D))
  h = x
  for i in range(4):
    h = kept.layer(i)(h)
  np.testing.assert_allclose(kept(x), h, rtol=1e-6)
