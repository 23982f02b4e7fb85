"""sr.save(blocking=False), sr.restore(path, model, *filters), and a save killed with
SIGKILL mid-write (the multi-process runs are in tests/test_multiprocess.py)."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import statefulremat as sr
from tests.test_checkpoint import Net, assert_same_state, assert_unchanged, data, snapshot, trained

# -- background saves ------------------------------------------------------------------


def test_a_background_save_keeps_what_the_model_held_at_the_call(tmp_path):
  model = trained(0)
  expected = sr.clone(model)
  handle = sr.save(tmp_path, model, blocking=False)
  assert isinstance(handle, sr.SaveHandle)
  # The model changes at once, in place (arrays replaced, a numpy array mutated).
  model.linear.kernel.value = model.linear.kernel.value + 1.0
  sr.jit(lambda m, x: m(x))(model, data())
  handle.wait()
  assert handle.done() and "committed" in repr(handle)
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, expected)


def test_a_numpy_variable_mutated_after_a_background_save_is_saved_as_it_was(tmp_path):
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  model.table = sr.Variable(np.arange(4.0))
  handle = sr.save(tmp_path, model, blocking=False)
  model.table.value[:] = -1.0  # numpy arrays change in place
  handle.wait()
  fresh = sr.nn.Linear(2, 2, rngs=sr.Rngs(1))
  fresh.table = sr.Variable(np.zeros(4))
  sr.restore(tmp_path, fresh)
  np.testing.assert_array_equal(fresh.table.value, np.arange(4.0))


def test_saves_and_restores_of_a_path_run_in_order(tmp_path):
  # Each waits for the previous background save of the path: the last one wins, and a
  # restore right after a background save reads it.
  handles = [sr.save(tmp_path, trained(seed), blocking=False) for seed in range(3)]
  fresh = Net(rngs=sr.Rngs(7))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, trained(2))
  for handle in handles:
    handle.wait()
  assert sorted(os.listdir(tmp_path)) == ["sr-3", "sr_checkpoint.json"]


def test_a_failed_background_save_raises_at_wait_and_keeps_the_previous(tmp_path, monkeypatch):
  import statefulremat.checkpoint._save_restore as checkpoint

  old = trained(0)
  sr.save(tmp_path, old)

  def broken_commit(root, version):
    raise OSError("disk full")

  monkeypatch.setattr(checkpoint, "commit", broken_commit)
  handle = sr.save(tmp_path, trained(2), blocking=False)
  with pytest.raises(OSError, match="disk full"):
    handle.wait()
  assert "failed" in repr(handle)
  monkeypatch.undo()
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, old)
  assert sorted(os.listdir(tmp_path)) == ["sr-1", "sr_checkpoint.json"]


def test_a_failed_background_save_nobody_waited_on_is_reported_by_the_next_call(
  tmp_path, monkeypatch
):
  import statefulremat.checkpoint._save_restore as checkpoint

  old = trained(0)
  sr.save(tmp_path, old)
  monkeypatch.setattr(checkpoint, "commit", lambda root, version: 1 / 0)
  handle = sr.save(tmp_path, trained(2), blocking=False)
  while not handle.done():  # not wait(): that would report the error
    time.sleep(0.01)
  monkeypatch.undo()
  fresh = Net(rngs=sr.Rngs(1))
  before = snapshot(fresh)
  with pytest.raises(
    sr.CheckpointError,
    match=(
      r"sr.restore: the earlier sr.save\(.*, blocking=False\) failed "
      r"\(ZeroDivisionError: .*\); the checkpoint there is the one before it. Nothing "
      r"was done now. Fix: call this again"
    ),
  ):
    sr.restore(tmp_path, fresh)
  assert_unchanged(fresh, before)
  sr.restore(tmp_path, fresh)  # reported once; the previous checkpoint is there
  assert_same_state(fresh, old)


def test_blocking_must_be_a_bool(tmp_path):
  with pytest.raises(
    TypeError,
    match=r"sr.save: blocking must be True or False, got "
    r"'no'",
  ):
    sr.save(tmp_path, trained(0), blocking="no")
  assert not os.listdir(tmp_path)


def test_wait_with_a_timeout(tmp_path):
  handle = sr.save(tmp_path, trained(0), blocking=False)
  handle.wait(timeout=60)
  handle.wait()  # waiting again is fine


# -- restoring part of a checkpoint -------------------------------------------------------


class Classifier(sr.Module):
  """A pretrained body (a Net) under a new head of another size."""

  def __init__(self, classes, *, rngs):
    self.body = Net(rngs=rngs)
    self.head = sr.nn.Linear(8, classes, rngs=rngs)


def test_restore_only_the_matching_variables(tmp_path):
  model = trained(0)
  sr.save(tmp_path, model)
  fresh = trained(1)
  stats_before = {p: v for p, v in sr.state(fresh, sr.BatchStat).flat().items()}
  sr.restore(tmp_path, fresh, sr.Param)
  for path, value in sr.state(fresh, sr.Param).flat().items():
    np.testing.assert_array_equal(value, sr.state(model, sr.Param).flat()[path])
  for path, value in sr.state(fresh, sr.BatchStat).flat().items():
    assert value is stats_before[path]  # not read, not written


def test_fine_tune_from_pretrained_params_under_a_new_head(tmp_path):
  pretrained = Classifier(8, rngs=sr.Rngs(0))
  sr.save(tmp_path, pretrained)
  model = Classifier(3, rngs=sr.Rngs(1))  # the head differs in shape
  head = model.head.kernel.value
  sr.restore(tmp_path, model, sr.All(sr.Param, sr.PathContains("body")))
  np.testing.assert_array_equal(model.body.linear.kernel.value, pretrained.body.linear.kernel.value)
  assert model.head.kernel.value is head
  # Without the path filter the head's shape differs, and nothing is written.
  before = snapshot(model)
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`head.kernel`: the checkpoint has a Param float32\[8,8\], the model a Param "
      r"float32\[8,3\]"
    ),
  ):
    sr.restore(tmp_path, model, sr.Param)
  assert_unchanged(model, before)


def test_a_filter_needs_the_matching_variables_in_the_checkpoint(tmp_path):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  model = Classifier(3, rngs=sr.Rngs(1))
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"the model has `body.linear.bias` \(a Param float32\[8\]\) but the checkpoint "
      r"does not"
    ),
  ):
    sr.restore(tmp_path, model, sr.Param)


@pytest.mark.parametrize(
  "filters, shown, hint",
  [(("param",), "'param'", r" Did you mean 'params'\?"), ((sr.Cache,), "sr.Cache", "")],
)
def test_a_filter_that_matches_nothing_raises(tmp_path, filters, shown, hint):
  sr.save(tmp_path, Net(rngs=sr.Rngs(0)))
  model = Net(rngs=sr.Rngs(1))
  before = snapshot(model)
  with pytest.raises(
    TypeError,
    match=(
      rf"sr.restore: the filters {shown} match no variable of the model, so nothing "
      r"would be restored. Its variables are in the collections: 'rngs' \(2\), "
      rf"'params' \(6\), 'batch_stats' \(2\).{hint} Fix: pass filters that match"
    ),
  ):
    sr.restore(tmp_path, model, *filters)
  assert_unchanged(model, before)


# -- a save killed mid-write -------------------------------------------------------------


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
  old = trained(0)
  sr.save(tmp_path, old)
  # A background save of a larger model, killed with SIGKILL while orbax is writing
  # its arrays (after the first array file is on disk, before the commit).
  script = textwrap.dedent(f"""
      import os, sys, time
      sys.path.insert(0, {str(pathlib.Path(__file__).parents[1])!r})
      import jax.numpy as jnp, orbax.checkpoint as ocp, statefulremat as sr
      import tests.test_checkpoint as t
      real = ocp.StandardCheckpointHandler.async_save
      async def slow(self, *args, **kwargs):
        futures = await real(self, *args, **kwargs)
        print("writing", flush=True)
        time.sleep(120)
        return futures
      ocp.StandardCheckpointHandler.async_save = slow
      model = t.trained(3)
      model.big = sr.Variable(jnp.ones((512, 512)))
      sr.save({str(tmp_path)!r}, model, blocking=False).wait()
  """)
  with subprocess.Popen(
    [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  ) as proc:
    try:
      line = proc.stdout.readline()
      assert line.strip() == "writing", proc.stderr.read()
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=60)
    finally:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL
  assert "sr-2" in os.listdir(tmp_path)  # the dead save's version, never pointed at
  fresh = Net(rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert_same_state(fresh, old)
  sr.save(tmp_path, trained(2))  # the next save removes the leftover
  assert sorted(os.listdir(tmp_path)) == ["sr-3", "sr_checkpoint.json"]
