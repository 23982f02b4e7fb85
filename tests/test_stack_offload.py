"""Where a stack's carries live: ``carries="offload"`` on sr.remat_scan and sr.scan
keeps the carries saved for the backward pass in host memory. On CPU nothing is
offloaded: the results equal ``carries="device"`` and one warning says so."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests._pattern_blocks import D, Gate, Mix

X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)
NOTHING = "nothing is offloaded"
HOST = jax.default_backend() == "cpu"  # where the warning is expected


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / D)

  def __call__(self, x):
    return jnp.tanh(x @ self.w.value) + x


class ScanBlock(Block):
  def __call__(self, x):
    return super().__call__(x), None


def _loss(model, x):
  return jnp.sum(model(x) ** 2)


def _scan_loss(model, x):
  return jnp.sum(model(x)[0] ** 2)


def _offloaded():
  """A context expecting the one CPU warning (nothing where the backend offloads)."""
  if HOST:
    return pytest.warns(UserWarning, match=NOTHING)
  return warnings.catch_warnings()


def _run(make, loss, carries):
  """Loss, gradients and the state after one value_and_grad of a fresh model, compiled as
  one program (eagerly, every op of the gradient compiles on its own)."""
  model = make(carries)
  value, grads = sr.jit(sr.value_and_grad(loss))(model, X)
  return value, jax.tree.leaves(grads), jax.tree.leaves(sr.state(model))


TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # float32, values up to ~20


def _check_equal(make, loss=_loss):
  expected = _run(make, loss, "device")
  with _offloaded() as record:
    got = _run(make, loss, "offload")
  if HOST:
    assert len([w for w in record if NOTHING in str(w.message)]) == 1
  # The two programs differ (a named, offloading policy or none), so XLA may order a sum
  # differently: float32 rounding, a few ulps; a wrong or stale carry is off by O(1).
  np.testing.assert_allclose(got[0], expected[0], rtol=TOLERANCE["rtol"])
  for a, b in zip(got[1] + got[2], expected[1] + expected[2], strict=True):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_allclose(a, b, **TOLERANCE)


# -- sr.remat_scan -------------------------------------------------------------------


@pytest.mark.parametrize(
  "lengths, length", [((6,), None), ((2, 3), None), ((3, 3), 7), ((2, 2, 2), None)]
)
def test_remat_scan_class_form_offload_equals_device(lengths, length):
  def make(carries):
    Stack = sr.remat_scan(Block, lengths=lengths, length=length, carries=carries)
    return Stack(rngs=sr.Rngs(0))

  _check_equal(make)


def test_remat_scan_function_form_offload_equals_device():
  stack = sr.remat_scan(Block, lengths=(7,))(rngs=sr.Rngs(1))

  def grads(carries):
    run = sr.remat_scan(lambda layer, c: layer(c), lengths=(3, 3), length=7, carries=carries)
    return sr.jit(sr.value_and_grad(lambda m, x: jnp.sum(run(m, x) ** 2)))(sr.clone(stack), X)

  expected = grads("device")
  with _offloaded():
    got = grads("offload")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, **TOLERANCE)


def test_remat_scan_decorator_and_policy_keep_their_meaning():
  policy = jax.checkpoint_policies.dots_saveable

  def make(carries):
    Stack = sr.remat_scan(lengths=(5,), carries=carries, policy=policy)(Block)
    return Stack(rngs=sr.Rngs(0))

  _check_equal(make)


@pytest.mark.parametrize("length", [8, 7])
def test_remat_scan_pattern_with_dropout_offload_equals_device(length):
  def make(carries):
    Stack = sr.remat_scan((Mix, Gate), lengths=(2, 2), length=length, carries=carries)
    return Stack(rngs=sr.Rngs(0))

  _check_equal(make)


def test_remat_scan_carried_batch_stat_offload_equals_device():
  class Counted(sr.Module):
    def __init__(self, counter, *, rngs):
      self.counter = counter
      self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / D)

    def __call__(self, x):
      self.counter.value = self.counter.value + 1.0
      return jnp.tanh(x @ self.w.value) * self.counter.value

  def make(carries):
    counter = sr.BatchStat(jnp.zeros((), jnp.float32))
    Stack = sr.remat_scan(Counted, lengths=(2, 3), variable_carry=sr.BatchStat, carries=carries)
    return Stack(counter, rngs=sr.Rngs(0))

  _check_equal(make)


# -- sr.scan -------------------------------------------------------------------------


@pytest.mark.parametrize("remat", [False, True])
def test_scan_offload_equals_device(remat):
  def make(carries):
    block = sr.remat(ScanBlock) if remat else ScanBlock
    Stack = sr.scan(
      block,
      length=4,
      variable_axes={sr.Param: 0},
      split_rngs={"params": True},
      carries=carries,
    )
    return Stack(rngs=sr.Rngs(0))

  _check_equal(make, _scan_loss)


class ScanMix(Mix):
  def __call__(self, x):
    return super().__call__(x), None


class ScanGate(Gate):
  def __call__(self, x):
    return super().__call__(x), None


def test_scan_pattern_offload_equals_device():
  def make(carries):
    Stack = sr.scan(
      (ScanMix, ScanGate),
      length=5,
      variable_axes={True: 0},
      split_rngs={True: True},
      carries=carries,
    )
    return Stack(rngs=sr.Rngs(0))

  _check_equal(make, _scan_loss)


# -- the offload is asked for --------------------------------------------------------


def _carry_residuals(model, loss):
  with _offloaded():
    saved = sr.saved_residuals(loss, model, X)
  return [r for r in saved if r.name == "sr_stack_carry"]


@pytest.mark.parametrize("lengths", [(4,), (2, 2)])
def test_remat_scan_offloads_the_outer_carries(lengths):
  Stack = sr.remat_scan(Block, lengths=lengths, carries="offload")
  carried = _carry_residuals(Stack(rngs=sr.Rngs(0)), _loss)
  assert carried and all(r.offloaded for r in carried)
  # One saved carry per outer step, with the outer axis in front.
  assert {r.shape for r in carried} == {(lengths[0], 2, D)}
  Plain = sr.remat_scan(Block, lengths=lengths)
  assert not any(r.offloaded for r in sr.saved_residuals(_loss, Plain(rngs=sr.Rngs(0)), X))


def test_scan_offloads_each_layers_input_and_the_jaxpr_moves_it_to_host():
  Stack = sr.scan(
    ScanBlock,
    length=4,
    variable_axes={sr.Param: 0},
    split_rngs={"params": True},
    carries="offload",
  )
  model = Stack(rngs=sr.Rngs(0))
  carried = _carry_residuals(model, _scan_loss)
  assert [(r.shape, r.offloaded) for r in carried] == [((4, 2, D), True)]
  grad_fn = sr.grad(_scan_loss)
  with _offloaded():
    text = str(jax.make_jaxpr(lambda x: grad_fn(model, x))(X))
  assert "<host>" in text


def test_a_remat_body_keeps_its_policy_under_scan_offload():
  def saved(carries):
    Stack = sr.scan(
      sr.remat(ScanBlock),
      length=4,
      variable_axes={sr.Param: 0},
      split_rngs={"params": True},
      carries=carries,
    )
    with _offloaded() if carries == "offload" else warnings.catch_warnings():
      residuals = sr.saved_residuals(_scan_loss, Stack(rngs=sr.Rngs(0)), X)
    return sorted((r.shape, r.offloaded) for r in residuals)

  device, offload = saved("device"), saved("offload")
  # The same residuals (the block's intermediates recomputed), the carries on the host.
  assert [shape for shape, _ in offload] == [shape for shape, _ in device]
  assert [on_host for _, on_host in offload].count(True) == 1


class Named(Block):
  def __call__(self, x):
    from jax.ad_checkpoint import checkpoint_name

    return jnp.tanh(checkpoint_name(x @ self.w.value, "h")) + x


def test_the_policy_is_still_checked_and_the_carry_name_stays_out_of_it():
  names = jax.checkpoint_policies.save_only_these_names
  Stack = sr.remat_scan(Named, lengths=(4,), policy=names("hh"), carries="offload")
  with (
    pytest.raises(
      sr.TransformError, match=r"(refers to the name 'hh'|keeps none).*The body names: 'h'\."
    ) as error,
    _offloaded(),
  ):
    _loss(Stack(rngs=sr.Rngs(0)), X)
  assert "sr_stack_carry" not in str(error.value)
  Stack = sr.remat_scan(Named, lengths=(4,), policy=names("h"), carries="offload")
  with _offloaded():
    saved = sr.saved_residuals(_loss, Stack(rngs=sr.Rngs(0)), X)
  assert {(r.name, r.offloaded) for r in saved if r.name} == {
    ("h", False),
    ("sr_stack_carry", True),
  }


# -- misuse --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "transform, carries",
  # remat_scan's None is its default: the plan's choice, else the device
  [("remat_scan", "host"), ("remat_scan", True), ("scan", "host"), ("scan", True), ("scan", None)],
)
def test_carries_must_be_device_or_offload(transform, carries):
  make = (
    (lambda c: sr.remat_scan(Block, lengths=(2,), carries=c))
    if transform == "remat_scan"
    else (lambda c: sr.scan(ScanBlock, length=2, variable_axes={sr.Param: 0}, carries=c))
  )
  with pytest.raises(sr.TransformError, match=rf"carries={carries!r}.*'device'.*'offload'"):
    make(carries)
  fn = getattr(sr, transform)
  with pytest.raises(sr.TransformError, match=r"carries='host'"):
    fn(lambda layer, c: layer(c), carries="host")


def test_a_refused_call_leaves_the_module_unchanged():
  stack = sr.remat_scan(Block, lengths=(3,))(rngs=sr.Rngs(0))
  before = jax.tree.leaves(sr.state(stack))
  with pytest.raises(sr.TransformError, match="carries='host'"):
    sr.remat_scan(lambda layer, c: layer(c), lengths=(3,), carries="host")(stack, X)
  for a, b in zip(jax.tree.leaves(sr.state(stack)), before, strict=True):
    assert a is b


# -- carries="device" is today's program ---------------------------------------------


def _lowered(model, loss):
  return sr.jit(sr.value_and_grad(loss)).lower(model, X).as_text()


def test_device_is_the_default_program():
  default = sr.remat_scan(Block, lengths=(3, 3), length=7)(rngs=sr.Rngs(0))
  device = sr.remat_scan(Block, lengths=(3, 3), length=7, carries="device")(rngs=sr.Rngs(0))
  assert _lowered(device, _loss) == _lowered(default, _loss)
  kw = dict(length=4, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  default = sr.scan(ScanBlock, **kw)(rngs=sr.Rngs(0))
  device = sr.scan(ScanBlock, carries="device", **kw)(rngs=sr.Rngs(0))
  assert _lowered(device, _scan_loss) == _lowered(default, _scan_loss)


def test_a_pipeline_passes_carries_to_each_stage():
  from jax.sharding import AxisType

  mesh = jax.make_mesh((8,), ("stage",), axis_types=(AxisType.Auto,))
  stack = sr.remat_scan(Block, lengths=(8,))(rngs=sr.Rngs(0))
  sr.shard(stack, mesh, [("layers", "stage")])
  spec = sr.PipelineSpec(microbatches=2)

  def grads(carries):
    run = sr.remat_scan(lambda layer, h: layer(h), lengths=(8,), carries=carries, pipeline=spec)
    with jax.set_mesh(mesh):
      return sr.jit(sr.value_and_grad(lambda m, x: jnp.sum(run(m, x) ** 2)))(stack, X)  # noqa: B023

  expected = grads("device")
  with _offloaded() as record:
    got = grads("offload")
  if HOST:
    assert len(record) == 1
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, **TOLERANCE)
