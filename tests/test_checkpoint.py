"""sr.save / sr.restore: round trips, resharding, remat_scan lengths, atomic saves and
every misuse's message."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

W = 8


class Net(sr.Module):
  """Linear -> BatchNorm -> relu -> Dropout -> Linear; Dropout keeps the Rngs."""

  def __init__(self, out=W, *, rngs, head_bias=True, param_dtype=jnp.float32):
    self.linear = sr.nn.Linear(W, W, param_dtype=param_dtype, rngs=rngs)
    self.norm = sr.nn.BatchNorm(W, momentum=0.5, rngs=rngs)
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)
    self.head = sr.nn.Linear(W, out, use_bias=head_bias, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(jax.nn.relu(self.norm(self.linear(x)))))


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.drop = sr.nn.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + 0.1 * self.drop(jnp.tanh(self.linear(x)))


def data(batch=4):
  return jnp.linspace(-1.0, 1.0, batch * W).reshape(batch, W)


# One compiled step instead of dozens of eagerly compiled ops keeps the file fast.
forward = sr.jit(lambda model, x: model(x))


def trained(seed=0):
  """A Net whose batch stats and RNG counts have moved away from their initial values."""
  model = Net(rngs=sr.Rngs(seed))
  forward(model, data())
  return model


def plain(value):
  if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(value))
  return np.asarray(value)


def assert_same_state(a, b):
  """Same paths, kinds, dtypes, Python types and values."""
  va, vb = sr.state(a).flat_variables(), sr.state(b).flat_variables()
  assert list(va) == list(vb)
  for path in va:
    x, y = va[path].value, vb[path].value
    assert type(va[path]) is type(vb[path]), path
    assert type(x) is type(y), path
    assert getattr(x, "dtype", None) == getattr(y, "dtype", None), path
    np.testing.assert_array_equal(plain(x), plain(y), err_msg=str(path))


def snapshot(model):
  """The value objects themselves: an untouched model still holds these very objects."""
  return [(p, v.value) for p, v in sr.state(model).flat_variables().items()]


def assert_unchanged(model, before):
  now = sr.state(model).flat()
  assert [p for p, _ in before] == list(now)
  for path, value in before:
    assert now[path] is value, f"{path} was written"


# -- round trips ---------------------------------------------------------------------


def test_round_trip_mlp_with_batchnorm_dropout_and_rngs(tmp_path):
  model = trained(0)
  sr.save(tmp_path / "ckpt", model)
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path / "ckpt", fresh)
  assert_same_state(fresh, model)
  assert fresh.drop.rngs.default.key.value.dtype == jax.random.key(0).dtype
  # Same state, so the same next step: dropout masks and batch statistics included.
  np.testing.assert_array_equal(forward(fresh, data()), forward(model, data()))
  assert_same_state(fresh, model)


def test_round_trip_optimizer_and_python_and_numpy_values(tmp_path):
  class Holder(sr.Module):
    def __init__(self, seed):
      self.count = sr.Variable(seed)
      self.rate = sr.Variable(seed + 0.5)
      self.flag = sr.Variable(bool(seed))
      self.table = sr.Cache(np.arange(3.0) + seed)
      self.scalar = sr.Cache(np.float32(seed))

  model = Net(rngs=sr.Rngs(0))
  opt = sr.Optimizer(model, optax.adam(1e-2))
  sr.jit(lambda opt: opt.update(sr.grad(lambda m: (m(data()) ** 2).mean())(opt.model)))(opt)
  sr.save(tmp_path, [opt, Holder(1)])
  fresh_opt = sr.Optimizer(Net(rngs=sr.Rngs(1)), optax.adam(1e-2))
  fresh_holder = Holder(0)
  sr.restore(tmp_path, [fresh_opt, fresh_holder])
  assert_same_state(fresh_opt, opt)
  assert_same_state(fresh_holder, Holder(1))
  assert fresh_holder.count.value == 1 and type(fresh_holder.count.value) is int
  assert type(fresh_holder.scalar.value) is np.float32


def test_saving_again_replaces_the_checkpoint(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  sr.save(tmp_path, trained(2))
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, trained(2))
  assert sorted(os.listdir(tmp_path)) == ["sr-2", "sr_checkpoint.json"]


def test_a_model_without_variables(tmp_path):
  sr.save(tmp_path, sr.nn.Dropout(0.5, rngs=None))
  sr.restore(tmp_path, sr.nn.Dropout(0.1, rngs=None))
  with pytest.raises(sr.StateMismatchError, match="the checkpoint does not"):
    sr.restore(tmp_path, sr.nn.Dropout(0.1, rngs=sr.Rngs(0)))


def test_relative_paths(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  model = trained(0)
  sr.save("ckpt", model)
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(pathlib.Path("ckpt"), fresh)
  assert_same_state(fresh, model)


# -- remat_scan: one flat layer axis, so any lengths ----------------------------------


def test_remat_scan_restores_into_any_lengths(tmp_path):
  x = data()
  stack = sr.remat_scan(Block, lengths=(4, 6))(W, rngs=sr.Rngs(0))
  forward(stack, x)  # move the RNG counts
  sr.save(tmp_path, stack)
  want = forward(stack, x)
  for lengths in [(8, 3), (24,)]:
    other = sr.remat_scan(Block, lengths=lengths)(W, rngs=sr.Rngs(7))
    sr.restore(tmp_path, other)
    assert other.linear.kernel.value.shape == (24, W, W)
    np.testing.assert_array_equal(forward(other, x), want)
    assert_same_state(other, stack)


# -- sharding -----------------------------------------------------------------------


def place(model, spec_of, mesh):
  """Puts each array of ``model`` on ``mesh`` with ``spec_of(value)``."""
  state = sr.state(model).flat()
  sr.update(
    model,
    sr.State({p: jax.device_put(v, NamedSharding(mesh, spec_of(v))) for p, v in state.items()}),
  )


def shardings(model):
  return {p: v.sharding for p, v in sr.state(model).flat().items()}


def test_restore_onto_the_models_current_shardings(tmp_path):
  devices = np.array(jax.devices())
  assert devices.size == 8, "tests/conftest.py asks for 8 CPU devices"
  saved_mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
  model = trained(0)
  place(
    model,
    lambda v: P("data", "model") if v.ndim == 2 else P("model") if v.ndim == 1 else P(),
    saved_mesh,
  )
  sr.save(tmp_path, model)

  # Another mesh, other specs: each array lands where the target model has it.
  target_mesh = Mesh(devices[::-1].reshape(4, 2), ("x", "y"))
  target = Net(rngs=sr.Rngs(1))
  place(
    target, lambda v: P(None, "x") if v.ndim == 2 else P("y") if v.ndim == 1 else P(), target_mesh
  )
  want = shardings(target)
  sr.restore(tmp_path, target)
  assert_same_state(target, model)
  assert shardings(target) == want
  assert target.linear.kernel.value.sharding.spec == P(None, "x")

  # One device (not the default one), from the sharded checkpoint.
  single = Net(rngs=sr.Rngs(1))
  sr.update(single, jax.device_put(sr.state(single), jax.devices()[5]))
  sr.restore(tmp_path, single)
  assert_same_state(single, model)
  assert all(
    s == jax.sharding.SingleDeviceSharding(jax.devices()[5]) for s in shardings(single).values()
  )


# -- atomic saves ---------------------------------------------------------------------


def interrupt_orbax_writing(monkeypatch):
  real = ocp.StandardCheckpointHandler.save

  def save(self, directory, *args, **kwargs):
    real(self, directory, *args, **kwargs)  # the arrays are on disk, not committed
    raise KeyboardInterrupt

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "save", save)


def interrupt_orbax_commit(monkeypatch):
  def finalize(self, directory):
    raise KeyboardInterrupt

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "finalize", finalize)


def interrupt_pointer_flip(monkeypatch):
  real = os.replace

  def replace(src, dst, *args, **kwargs):
    if os.fspath(dst).endswith("sr_checkpoint.json"):
      raise KeyboardInterrupt
    return real(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize(
  "interrupt", [interrupt_orbax_writing, interrupt_orbax_commit, interrupt_pointer_flip]
)
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, interrupt):
  old = trained(0)
  sr.save(tmp_path, old)
  listing = sorted(os.listdir(tmp_path))
  with monkeypatch.context() as patch:
    interrupt(patch)
    with pytest.raises(KeyboardInterrupt):
      sr.save(tmp_path, trained(2))
  assert sorted(os.listdir(tmp_path)) == listing  # the failed save cleaned up
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, old)
  sr.save(tmp_path, trained(2))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, trained(2))


def test_crashed_save_leaves_the_previous_checkpoint_and_is_cleaned_up(tmp_path):
  old = trained(0)
  sr.save(tmp_path, old)
  # A hard crash part way (no Python cleanup runs): os._exit once orbax has written
  # the arrays of the new version.
  crash = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parents[1])!r})
      import orbax.checkpoint as ocp, statefulremat as sr
      real = ocp.StandardCheckpointHandler.save
      def save(self, *args, **kwargs):
        real(self, *args, **kwargs)
        os._exit(3)
      ocp.StandardCheckpointHandler.save = save
      sr.save({str(tmp_path)!r}, sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))
  """)
  result = subprocess.run(
    [sys.executable, "-c", crash], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 3, result.stderr
  assert sorted(os.listdir(tmp_path)) == ["sr-1", "sr-2", "sr_checkpoint.json"]
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)  # the leftover sr-2 is ignored
  assert_same_state(fresh, old)
  sr.save(tmp_path, trained(2))  # and removed by the next save
  assert sorted(os.listdir(tmp_path)) == ["sr-3", "sr_checkpoint.json"]
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, trained(2))


# -- restore leaves the model unchanged on any error -------------------------------


class Fragile(sr.Variable):
  """Refuses a write while ``armed``, as a KeyboardInterrupt mid write-back would."""

  armed = False

  @property
  def value(self):
    return self._value

  @value.setter
  def value(self, new):
    if Fragile.armed:
      raise KeyboardInterrupt
    self._value = new


class Last(sr.Module):
  def __init__(self, seed):
    self.net = Net(rngs=sr.Rngs(seed))
    self.zz = Fragile(jnp.full(3, float(seed)))  # walked last


def interrupt_reading(monkeypatch):
  def restore(self, *args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(ocp.Checkpointer, "restore", restore)


def interrupt_rewrapping_keys(monkeypatch):
  def wrap_key_data(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(jax.random, "wrap_key_data", wrap_key_data)


def interrupt_writing_back(monkeypatch):
  monkeypatch.setattr(Fragile, "armed", True)


@pytest.mark.parametrize(
  "interrupt", [interrupt_reading, interrupt_rewrapping_keys, interrupt_writing_back]
)
def test_keyboard_interrupt_in_restore_leaves_the_model_unchanged(tmp_path, monkeypatch, interrupt):
  sr.save(tmp_path, Last(0))
  model = Last(1)
  before = snapshot(model)
  with monkeypatch.context() as patch:
    interrupt(patch)
    with pytest.raises(KeyboardInterrupt):
      sr.restore(tmp_path, model)
  assert_unchanged(model, before)
  sr.restore(tmp_path, model)
  assert_same_state(model, Last(0))


# -- misuse ---------------------------------------------------------------------------


def test_restore_from_nothing(tmp_path):
  model = Net(rngs=sr.Rngs(0))
  with pytest.raises(
    FileNotFoundError, match=r"no checkpoint at '.*nope' \(the path does not exist\)"
  ):
    sr.restore(tmp_path / "nope", model)
  with pytest.raises(sr.CheckpointError, match="holds no finished sr.save"):
    sr.restore(tmp_path, model)  # an empty directory


def test_restore_from_something_else(tmp_path):
  (tmp_path / "notes.txt").write_text("hi")
  model = Net(rngs=sr.Rngs(0))
  with pytest.raises(sr.CheckpointError, match=r"is not a statefulremat checkpoint: .*'notes.txt'"):
    sr.restore(tmp_path, model)
  with pytest.raises(sr.CheckpointError, match="is a file, not a checkpoint directory"):
    sr.restore(tmp_path / "notes.txt", model)


def test_save_refuses_files_and_foreign_directories(tmp_path):
  (tmp_path / "notes.txt").write_text("hi")
  model = Net(rngs=sr.Rngs(0))
  with pytest.raises(sr.CheckpointError, match="is a file.*pass a new path"):
    sr.save(tmp_path / "notes.txt", model)
  with pytest.raises(
    sr.CheckpointError, match="not a statefulremat checkpoint.*save into a new or empty"
  ):
    sr.save(tmp_path, model)
  assert os.listdir(tmp_path) == ["notes.txt"]
  assert (tmp_path / "notes.txt").read_text() == "hi"


def test_damaged_pointer(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  (tmp_path / "sr_checkpoint.json").write_text('{"current": "sr-9"}')
  with pytest.raises(sr.CheckpointError, match=r"damaged or names a missing version"):
    sr.restore(tmp_path, Net(rngs=sr.Rngs(0)))


@pytest.mark.parametrize(
  "saved, model, message",
  [
    (
      lambda: Net(rngs=sr.Rngs(0)),
      lambda: Net(rngs=sr.Rngs(0), head_bias=False),
      r"the checkpoint has `head.bias` \(a Param float32\[8\]\) but the model does not",
    ),
    (
      lambda: Net(rngs=sr.Rngs(0), head_bias=False),
      lambda: Net(rngs=sr.Rngs(0)),
      r"the model has `head.bias` \(a Param float32\[8\]\) but the checkpoint does not",
    ),
    (
      lambda: Net(rngs=sr.Rngs(0)),
      lambda: Net(4, rngs=sr.Rngs(0)),
      r"`head.bias`: the checkpoint has a Param float32\[8\], the model a Param "
      r"float32\[4\] \(and 1 more difference\)",
    ),
    (
      lambda: Net(rngs=sr.Rngs(0)),
      lambda: Net(rngs=sr.Rngs(0), param_dtype=jnp.bfloat16),
      r"`linear.bias`: the checkpoint has a Param float32\[8\], the model a Param "
      r"bfloat16\[8\]",
    ),
    (
      lambda: Net(rngs=sr.Rngs(0)),
      lambda: Net(rngs=sr.Rngs(jax.random.key(0, impl="rbg"))),
      r"`drop.rngs.default.key`: the checkpoint has a RngKey key<fry>\[\], the model a "
      r"RngKey key<rbg>\[\]",
    ),
    (
      lambda: sr.Param(jnp.zeros(3)),
      lambda: sr.BatchStat(jnp.zeros(3)),
      r"`<root>`: the checkpoint has a Param float32\[3\], the model a BatchStat",
    ),
  ],
  ids=["extra", "missing", "shape", "dtype", "key-impl", "kind"],
)
def test_mismatch_names_the_first_difference(tmp_path, saved, model, message):
  sr.save(tmp_path, saved())
  model = model()
  before = snapshot(model)
  with pytest.raises(sr.StateMismatchError, match=message) as info:
    sr.restore(tmp_path, model)
  assert "nothing was restored" in str(info.value)
  assert "Fix: restore into a model built the way the saved one was" in str(info.value)
  assert_unchanged(model, before)


def test_model_argument_must_be_a_module(tmp_path):
  model = Net(rngs=sr.Rngs(0))
  sr.save(tmp_path, model)
  for fn in (sr.save, sr.restore):
    with pytest.raises(TypeError, match=r"got a State.*pass the module"):
      fn(tmp_path, sr.state(model))
    with pytest.raises(TypeError, match=r"got ndarray as the model"):
      fn(tmp_path, np.zeros(3))
    with pytest.raises(TypeError, match=r"takes the checkpoint path first.*got Net"):
      fn(model, tmp_path)


@pytest.mark.parametrize(
  "value, message",
  [
    (None, r"`v` \(Variable\) holds a NoneType \(not an array\)"),
    ("hello", r"`v` \(Variable\) holds a str \(not an array\)"),
    (
      2**70,
      r"`v` \(Variable\) holds the Python int 1180591620717411303424, which "
      "does not fit in 64 bits",
    ),
  ],
)
def test_save_rejects_values_it_cannot_store(tmp_path, value, message):
  class Odd(sr.Module):
    def __init__(self):
      self.v = sr.Variable(value)

  with pytest.raises(TypeError, match=message):
    sr.save(tmp_path / "ckpt", Odd())
  assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("fn", [sr.save, sr.restore])
def test_inside_a_transform_is_refused(tmp_path, fn):
  sr.save(tmp_path, sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))

  @sr.jit
  def step(model):
    fn(tmp_path, model)

  with pytest.raises(
    TypeError, match=f"holds a traced value: sr.{fn.__name__} was called inside a JAX transform"
  ):
    step(sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))
