"""sr.restore never gives a silent wrong or stale result: a damaged checkpoint is not a
missing one, Python-number Variables round-trip through training, and a mismatch
lists what differs."""

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


class Net(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(3, 4, rngs=rngs)
    self.norm = sr.nn.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.linear(x))


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
forward = sr.jit(lambda model, x: model(x))


def snapshot(model):
  return [(p, v) for p, v in sr.state(model).flat().items()]


def assert_unchanged(model, before):
  now = sr.state(model).flat()
  assert [p for p, _ in before] == list(now)
  for path, value in before:
    assert now[path] is value, f"{path} was written"


def array_files(checkpoint: pathlib.Path) -> list[pathlib.Path]:
  """The files orbax keeps the arrays' bytes in (under a `d/` directory)."""
  files = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files, sorted(map(str, checkpoint.rglob("*")))
  return files


# -- 1. a damaged checkpoint is not a missing one ----------------------------------------


def test_checkpoint_error_is_not_an_os_error():
  assert not issubclass(sr.CheckpointError, OSError)
  assert issubclass(sr.CheckpointError, sr.StatefulRematError)


def restore_refuses(tmp_path, match):
  """sr.restore raises CheckpointError (never a FileNotFoundError) and keeps the model."""
  model = Net(rngs=sr.Rngs(1))
  before = snapshot(model)
  with pytest.raises(sr.CheckpointError, match=match) as info:
    try:
      sr.restore(tmp_path, model)
    except FileNotFoundError:  # a resume loop's "start fresh" must not swallow it
      pytest.fail("a damaged checkpoint was reported as a missing one")
  assert not isinstance(info.value, OSError)
  assert_unchanged(model, before)
  forward(model, X)  # still usable
  return model


def test_missing_array_files_raise_checkpoint_error_not_file_not_found(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  files = array_files(tmp_path)
  for path in files:
    path.unlink()
  more = len(files) - 1
  model = restore_refuses(
    tmp_path,
    rf"sr.restore: the checkpoint in '.*sr-1' is damaged: '.*/state/d/"
    rf"[0-9a-f]+' is missing \(and {more} more files?\)\. This is not a missing "
    r"checkpoint; nothing was restored and the model is unchanged\. Fix: restore "
    r"from another \(earlier\) checkpoint",
  )
  sr.save(tmp_path, model)  # a new save over the damaged one works
  fresh = Net(rngs=sr.Rngs(2))
  sr.restore(tmp_path, fresh)
  np.testing.assert_array_equal(forward(fresh, X), forward(model, X))


def test_truncated_array_file(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  path = array_files(tmp_path)[0]
  size = path.stat().st_size
  path.write_bytes(path.read_bytes()[: size // 2])
  restore_refuses(
    tmp_path,
    rf"is damaged: '{path}' has {size // 2} bytes instead of "
    rf"the {size} saved\. This is not a missing checkpoint",
  )


def test_missing_orbax_directory_is_damage_too(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  (state,) = tmp_path.glob("sr-*/state")
  shutil.rmtree(state)
  restore_refuses(
    tmp_path,
    r"is damaged: '.*/state/[^']+' is missing \(and \d+ more "
    r"files\)",
  )


@pytest.mark.parametrize(
  "error, match",
  [
    (
      FileNotFoundError("Checkpoint at /x/state not found."),
      r"its array data cannot be read \(FileNotFoundError: Checkpoint at /x/state not "
      r"found\.\)",
    ),
    (
      ValueError(
        'DATA_LOSS: Error opening "zarr" driver: Error reading "1/.zarray" in '
        'OCDBT database at local file "/x/state/": Error reading local file '
        '"/x/state/d/abc" [tensorstore_spec=...]'
      ),
      r"the array of `linear.kernel` cannot be read \(tensorstore: DATA_LOSS, file "
      r"'/x/state/d/abc'\)\. Its variables.json is intact, so this is not a missing "
      r"checkpoint",
    ),
  ],
  ids=["file-not-found", "tensorstore"],
)
def test_orbax_read_errors_become_checkpoint_errors(tmp_path, monkeypatch, error, match):
  # What the file check cannot see (bytes changed in place) orbax reports; its
  # FileNotFoundError must not escape either.
  import orbax.checkpoint as ocp

  def restore(self, *args, **kwargs):
    raise error

  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  monkeypatch.setattr(ocp.Checkpointer, "restore", restore)
  restore_refuses(tmp_path, match)


def test_no_checkpoint_at_all_is_still_file_not_found(tmp_path):
  model = Net(rngs=sr.Rngs(0))
  with pytest.raises(
    FileNotFoundError,
    match=r"there is no checkpoint at '.*nope' \(the path does not "
    r"exist\)\. Fix: check the path",
  ) as info:
    sr.restore(tmp_path / "nope", model)
  assert isinstance(info.value, sr.CheckpointError)


# -- 2. Python numbers are the 0-d arrays JAX makes of them -------------------------------


class Counters(sr.Module):
  def __init__(self):
    self.scale = sr.Param(1.0)
    self.seen = sr.BatchStat(0)
    self.flag = sr.Variable(True)


@sr.jit
def train_step(model):
  model.scale.value = model.scale.value * 2
  model.seen.value = model.seen.value + 1
  model.flag.value = jnp.logical_not(model.flag.value)


def assert_holds(model, scale, seen, flag):
  """The values, as jax arrays of JAX's dtypes (a trained model's)."""
  for var, want, dtype in [
    (model.scale, scale, jnp.float32),
    (model.seen, seen, jnp.int32),
    (model.flag, flag, jnp.bool_),
  ]:
    assert isinstance(var.value, jax.Array), var
    assert var.value.dtype == dtype and var.value.shape == ()
    assert var.value.item() == want


def assert_holds_python(model, scale, seen, flag):
  """The values, as the Python numbers a fresh model holds."""
  for var, want in [(model.scale, scale), (model.seen, seen), (model.flag, flag)]:
    assert type(var.value) is type(want) and var.value == want, var


def test_python_numbers_restore_after_training(tmp_path):
  model = Counters()
  sr.save(tmp_path, model)  # before training: Python numbers
  train_step(model)  # now int32[] / float32[] / bool[] arrays
  sr.restore(tmp_path, model)
  assert_holds(model, 1.0, 0, True)
  train_step(model)
  assert_holds(model, 2.0, 1, False)


def test_trained_checkpoint_restores_into_a_fresh_model(tmp_path):
  model = Counters()
  train_step(model)
  train_step(model)
  sr.save(tmp_path, model)
  fresh = Counters()  # Python numbers
  sr.restore(tmp_path, fresh)
  assert_holds_python(fresh, 4.0, 2, True)
  train_step(fresh)
  assert_holds(fresh, 8.0, 3, False)


def test_python_number_restores_into_python_number(tmp_path):
  sr.save(tmp_path, Counters())
  model = Counters()
  sr.restore(tmp_path, model)
  assert_holds_python(model, 1.0, 0, True)


class One(sr.Module):
  def __init__(self, value):
    self.v = sr.Variable(value)


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="about 32-bit defaults")
@pytest.mark.parametrize(
  "value, message",
  [
    (
      2**40,
      r"`v` \(Variable\) holds the Python int 1099511627776, which does not "
      r"fit in int32, the dtype JAX gives a Python int .*Fix: enable 64-bit "
      r"types .*np\.int64",
    ),
    (
      1e300,
      r"holds the Python float 1e\+300, which does not fit in float32.*"
      r"np\.float64",
    ),
  ],
)
def test_python_number_that_does_not_fit_its_jax_dtype(tmp_path, value, message):
  with pytest.raises(TypeError, match=message):
    sr.save(tmp_path / "ckpt", One(value))
  assert not (tmp_path / "ckpt").exists()


def test_a_dtype_mismatch_with_a_python_number_names_both(tmp_path):
  sr.save(tmp_path, One(1.0))
  model = One(jnp.zeros((), jnp.int32))
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`v`: the checkpoint has a Variable float32\[\], the model "
    r"a Variable int32\[\]",
  ):
    sr.restore(tmp_path, model)
  assert model.v.value.dtype == jnp.int32


# -- 3. a mismatch lists up to five differences ------------------------------------------


class Stack(sr.Module):
  def __init__(self, width, n=4):
    self.layers = [sr.nn.Linear(2, width, rngs=sr.Rngs(i)) for i in range(n)]


def test_mismatch_lists_five_differences_and_counts_the_rest(tmp_path):
  sr.save(tmp_path, Stack(3))
  model = Stack(5)
  before = snapshot(model)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.restore(tmp_path, model)
  lines = str(info.value).splitlines()
  assert lines[0].startswith(
    "sr.restore: `layers[0].bias`: the checkpoint has a Param float32[3], the model "
    "a Param float32[5] (and 7 more differences); nothing was restored from"
  )
  assert lines[1:6] == [
    "  also `layers[0].kernel`: the checkpoint has a Param float32[2,3], the model a "
    "Param float32[2,5]",
    "  also `layers[1].bias`: the checkpoint has a Param float32[3], the model a Param float32[5]",
    "  also `layers[1].kernel`: the checkpoint has a Param float32[2,3], the model a "
    "Param float32[2,5]",
    "  also `layers[2].bias`: the checkpoint has a Param float32[3], the model a Param float32[5]",
    "  and 3 more",
  ]
  assert lines[6].startswith("Fix: restore into a model built the way the saved one was")
  assert_unchanged(model, before)


class Mixed(sr.Module):
  def __init__(self, saved: bool):
    z = jnp.zeros
    self.a = sr.Param(z(3) if saved else z(4))  # shape
    self.b = sr.Param(z(2) if saved else z(2, jnp.bfloat16))  # dtype
    self.c = sr.Param(z(2)) if saved else sr.BatchStat(z(2))  # kind
    if saved:
      self.d = sr.Param(z(1))  # checkpoint only
    else:
      self.e = sr.Param(z(1))  # model only


def test_mismatch_says_what_differs_for_each(tmp_path):
  sr.save(tmp_path, Mixed(saved=True))
  model = Mixed(saved=False)
  before = snapshot(model)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"(?s)`a`: the checkpoint has a Param float32\[3\], the model a Param "
    r"float32\[4\] \(and 4 more differences\); nothing was restored from '.*'\.\n"
    r"  also `b`: the checkpoint has a Param float32\[2\], the model a Param "
    r"bfloat16\[2\]\n"
    r"  also `c`: the checkpoint has a Param float32\[2\], the model a BatchStat "
    r"float32\[2\]\n"
    r"  also the model has `e` \(a Param float32\[1\]\) but the checkpoint does not\n"
    r"  also the checkpoint has `d` \(a Param float32\[1\]\) but the model does not\n"
    r"Fix: ",
  ) as info:
    sr.restore(tmp_path, model)
  assert "more\n" not in str(info.value)
  assert_unchanged(model, before)
  sr.restore(tmp_path, Mixed(saved=True))  # the checkpoint itself is fine
