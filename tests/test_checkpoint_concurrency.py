"""Checkpoints lose nothing under concurrency: saves to one path from threads or
processes run one after the other, no save deletes a version it did not supersede, a
failed save releases the path, and a restore during saves reads a whole committed
checkpoint (the last one) without waiting for a save to end."""

import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import statefulremat as sr
import statefulremat.checkpoint._files as files
import statefulremat.checkpoint._locks as file_locks

ROOT = pathlib.Path(__file__).resolve().parents[1]
POINTER = "sr_checkpoint.json"
TIMEOUT = 60  # seconds for any thread or process of a test; a hang is a lock not released


class Net(sr.Module):
  """Every variable holds ``k``: a restore that mixed two saves would show two values."""

  def __init__(self, k):
    self.kernel = sr.Param(jnp.full((8, 16), k, jnp.float32))
    self.bias = sr.Param(jnp.full((16,), k, jnp.float32))
    self.mean = sr.BatchStat(np.full((16,), k, np.float32))
    self.count = sr.Variable(jnp.asarray(k, jnp.float32))


def restored(path) -> float:
  """The ``k`` of the model ``path`` holds, checking all its variables agree."""
  model = Net(-1.0)
  sr.restore(path, model)
  values = {float(x) for value in sr.state(model).flat().values() for x in np.ravel(value)}
  assert len(values) == 1, f"a restore mixed the variables of several saves: {values}"
  return values.pop()


def assert_one_version(path):
  names = sorted(os.listdir(path))
  assert len(names) == 2 and re.fullmatch(r"sr-\d+", names[0]), names
  assert names[1] == POINTER, names


class Worker(threading.Thread):
  """A daemon thread that keeps what ``fn`` raised (a hung one cannot block pytest)."""

  def __init__(self, fn, *args, name=None):
    super().__init__(target=self._run, args=(fn, *args), name=name, daemon=True)
    self.error = None
    self.start()

  def _run(self, fn, *args):
    try:
      fn(*args)
    except BaseException as e:  # joined() reports it
      self.error = e


def joined(*workers):
  deadline = time.monotonic() + TIMEOUT
  for worker in workers:
    worker.join(max(0.0, deadline - time.monotonic()))
  assert not [w.name for w in workers if w.is_alive()], "hung: a lock was not released"
  errors = [(w.name, repr(w.error)) for w in workers if w.error is not None]
  assert not errors, errors


def saves(path, values, name=None):
  """Saves ``Net(k)`` for each ``k`` in turn, every other one in the background."""
  handles = []
  for i, k in enumerate(values):
    handles.append(sr.save(path, Net(k), blocking=i % 2 == 0))
  for handle in handles:
    if handle is not None:
      handle.wait(TIMEOUT)


@pytest.fixture(params=["os-and-thread-locks", "os-locks-only", "thread-locks-only"])
def locks(request, monkeypatch):
  """Both layers of locks, or one: ``flock`` (what orders processes) or the threads'
  (all there is where ``flock`` is missing, as on Windows)."""
  if request.param == "os-locks-only":
    monkeypatch.setattr(file_locks, "threads_of", lambda root: file_locks._Threads())
  elif request.param == "thread-locks-only":
    monkeypatch.setattr(file_locks, "fcntl", None)
  return request.param


# -- saves run one after the other -------------------------------------------------------


def test_saves_from_threads_run_one_after_the_other(tmp_path, locks):
  sr.save(tmp_path, Net(0.0))
  plans = [[10.0 * t + i for i in range(1, 6)] for t in range(1, 5)]  # 4 threads x 5
  joined(*[Worker(saves, tmp_path, plan, name=f"writer-{t}") for t, plan in enumerate(plans)])
  # Each thread's saves commit in its order, so the last one committed is a last one.
  assert restored(tmp_path) in [plan[-1] for plan in plans]
  assert_one_version(tmp_path)


WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
import statefulremat as sr
import tests.test_checkpoint_concurrency as t
print("ready", flush=True)
deadline = time.monotonic() + {timeout}
while not os.path.exists({go!r}):  # both processes start saving together
  assert time.monotonic() < deadline, "never told to go"
  time.sleep(0.005)
t.saves({path!r}, {values!r})
"""


def test_saves_from_two_processes_run_one_after_the_other(tmp_path):
  path, go = tmp_path / "ckpt", tmp_path / "go"
  sr.save(path, Net(0.0))
  plans = [[10.0 * p + i for i in range(1, 7)] for p in (1, 2)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  logs = [open(tmp_path / f"writer-{p}.log", "w+") for p in range(2)]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-c",
        WRITER.format(root=str(ROOT), timeout=TIMEOUT, go=str(go), path=str(path), values=plan),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=logs[p],
      text=True,
    )
    for p, plan in enumerate(plans)
  ]
  watchdog = threading.Timer(2 * TIMEOUT, lambda: [p.kill() for p in procs])
  watchdog.start()
  try:
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
    go.touch()
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
  finally:
    watchdog.cancel()
    for p in procs:
      p.kill()
      p.stdout.close()
  text = ""
  for p, log in enumerate(logs):
    log.seek(0)
    text += f"--- writer {p}:\n{log.read()[-3000:]}"
    log.close()
  assert codes == [0, 0], text
  assert restored(path) in [plan[-1] for plan in plans]  # the last one committed
  assert_one_version(path)


# -- restores during saves ---------------------------------------------------------------


def test_restores_during_saves_read_whole_committed_checkpoints(tmp_path, locks):
  sr.save(tmp_path, Net(0.0))
  plan = [float(k) for k in range(1, 9)]
  seen = []

  def restores(writer):
    while writer.is_alive() or len(seen) < 3:
      seen.append(restored(tmp_path))

  writer = Worker(saves, tmp_path, plan, name="writer")
  joined(writer, Worker(restores, writer, name="reader"))
  assert set(seen) <= {0.0, *plan}
  assert seen == sorted(seen), "a restore read an older checkpoint than one before it"
  assert restored(tmp_path) == plan[-1]
  assert_one_version(tmp_path)


@pytest.fixture
def paused_restore(monkeypatch):
  """Pauses every restore once it holds its version, until ``resume`` is set."""
  reading, resume = threading.Event(), threading.Event()
  real = ocp.Checkpointer.restore

  def restore(self, *args, **kwargs):
    reading.set()
    assert resume.wait(TIMEOUT)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(ocp.Checkpointer, "restore", restore)
  return reading, resume


def pointer(path) -> str:
  return files.read_json(os.path.join(path, POINTER))["current"]


def wait_for(condition):
  deadline = time.monotonic() + TIMEOUT
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.005)


def test_a_save_never_deletes_the_version_a_restore_is_reading(tmp_path, locks, paused_restore):
  reading, resume = paused_restore
  sr.save(tmp_path, Net(1.0))
  values = []
  reader = Worker(lambda: values.append(restored(tmp_path)), name="reader")
  assert reading.wait(TIMEOUT)
  writer = Worker(sr.save, tmp_path, Net(2.0), name="writer")
  wait_for(lambda: pointer(tmp_path) == "sr-2")  # committed, while sr-1 is read
  time.sleep(0.2)  # time enough to delete sr-1, were it not being read
  assert sorted(os.listdir(tmp_path)) == ["sr-1", "sr-2", POINTER]
  resume.set()
  joined(reader, writer)
  assert values == [1.0]  # the whole checkpoint committed when the restore began
  assert sorted(os.listdir(tmp_path)) == ["sr-2", POINTER]  # deleted once read


def test_a_restore_during_a_save_reads_the_last_committed_without_waiting(tmp_path, monkeypatch):
  sr.save(tmp_path, Net(1.0))
  writing, resume = threading.Event(), threading.Event()
  real = ocp.StandardCheckpointHandler.finalize

  def finalize(self, directory):  # the new version's arrays are written, not committed
    writing.set()
    assert resume.wait(TIMEOUT)
    return real(self, directory)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "finalize", finalize)
  writer = Worker(sr.save, tmp_path, Net(2.0), name="writer")
  assert writing.wait(TIMEOUT)
  assert restored(tmp_path) == 1.0  # while the save holds the path's lock
  resume.set()
  joined(writer)
  assert restored(tmp_path) == 2.0


# -- a save deletes only what it supersedes ----------------------------------------------


def test_a_save_never_deletes_a_version_it_did_not_supersede(tmp_path, monkeypatch):
  sr.save(tmp_path, Net(1.0))  # sr-1, current
  (tmp_path / "sr-2").mkdir()  # a dead save's version (its process was killed)
  real = ocp.StandardCheckpointHandler.finalize

  def finalize(self, directory):
    # A version numbered above this save's sr-3 appears before it commits, as from a
    # writer the lock does not reach: the commit must not delete it.
    (tmp_path / "sr-4").mkdir()
    (tmp_path / "sr-4" / "written").write_text("not yet committed")
    return real(self, directory)

  with monkeypatch.context() as patch:
    patch.setattr(ocp.StandardCheckpointHandler, "finalize", finalize)
    sr.save(tmp_path, Net(2.0))
  # The previous current one and the dead one below are gone; sr-4 is untouched.
  assert sorted(os.listdir(tmp_path)) == ["sr-3", "sr-4", POINTER]
  assert (tmp_path / "sr-4" / "written").read_text() == "not yet committed"
  assert restored(tmp_path) == 2.0
  sr.save(tmp_path, Net(3.0))  # sr-5: now sr-4 is a dead version below it
  assert sorted(os.listdir(tmp_path)) == ["sr-5", POINTER]
  assert restored(tmp_path) == 3.0


# -- a failed save releases the path -----------------------------------------------------


def fail_writing(patch):
  def save(self, *args, **kwargs):
    raise OSError("disk full")

  patch.setattr(ocp.StandardCheckpointHandler, "save", save)
  patch.setattr(ocp.StandardCheckpointHandler, "async_save", save)


def fail_flipping(patch):
  real = os.replace

  def replace(src, dst, *args, **kwargs):
    if os.fspath(dst).endswith(POINTER):
      assert os.path.isfile(src)  # this writer's temporary, removed after the failure
      raise OSError("disk full")
    return real(src, dst, *args, **kwargs)

  patch.setattr(os, "replace", replace)


@pytest.mark.parametrize("fail", [fail_writing, fail_flipping])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_failed_save_releases_the_path_and_leaves_nothing(tmp_path, monkeypatch, fail, blocking):
  sr.save(tmp_path, Net(1.0))
  listing = sorted(os.listdir(tmp_path))
  with monkeypatch.context() as patch:
    fail(patch)
    with pytest.raises(OSError, match="disk full"):
      handle = sr.save(tmp_path, Net(2.0), blocking=blocking)
      if handle is not None:
        handle.wait(TIMEOUT)
  assert sorted(os.listdir(tmp_path)) == listing  # no version, no temporary pointer
  assert restored(tmp_path) == 1.0
  # The next saves, from another thread (a lock this one still held would stop it)
  # and from this one, go through at once.
  joined(Worker(sr.save, tmp_path, Net(3.0), name="next save"))
  assert restored(tmp_path) == 3.0
  sr.save(tmp_path, Net(4.0))
  assert restored(tmp_path) == 4.0
  assert_one_version(tmp_path)


def test_a_save_refused_before_writing_releases_the_path(tmp_path):
  class Odd(sr.Module):
    def __init__(self):
      self.v = sr.Variable("text")

  path, other = tmp_path / "ckpt", tmp_path / "other"
  sr.save(path, Net(1.0))
  with pytest.raises(
    TypeError,
    match=r"sr.save: `v` \(Variable\) holds a str \(not an "
    r"array\); .* Nothing was written",
  ):
    sr.save(path, Odd())
  other.mkdir()
  (other / "notes.txt").write_text("hi")
  with pytest.raises(
    sr.CheckpointError,
    match=r"is not a statefulremat checkpoint: it "
    r"has no sr_checkpoint.json and holds other files \('notes.txt'\)",
  ):
    sr.save(other, Net(2.0))
  assert os.listdir(other) == ["notes.txt"]
  joined(Worker(sr.save, path, Net(2.0), name="next save"))
  assert restored(path) == 2.0
  assert_one_version(path)


# -- the earlier checkpoint stays loadable -----------------------------------------------


def test_the_last_committed_checkpoint_survives_whatever_concurrent_saves_do(tmp_path, monkeypatch):
  sr.save(tmp_path, Net(0.0))
  # Saves that fail part way, from two threads, while a third saves and a fourth
  # restores: every restore reads a committed checkpoint, the newest so far.
  real_save, real_replace = ocp.StandardCheckpointHandler.save, os.replace

  def save(self, *args, **kwargs):
    if threading.current_thread().name == "fails writing":
      raise OSError("disk full")
    return real_save(self, *args, **kwargs)

  def replace(src, dst, *args, **kwargs):
    if threading.current_thread().name == "fails committing" and os.fspath(dst).endswith(POINTER):
      raise OSError("disk full")
    return real_replace(src, dst, *args, **kwargs)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "save", save)
  monkeypatch.setattr(os, "replace", replace)

  def failing():
    for k in range(4):
      with pytest.raises(OSError, match="disk full"):
        sr.save(tmp_path, Net(-2.0 - k))

  plan = [float(k) for k in range(1, 6)]
  seen = []

  def restores(writers):
    while any(w.is_alive() for w in writers) or len(seen) < 3:
      seen.append(restored(tmp_path))

  writers = [
    Worker(failing, name="fails writing"),
    Worker(failing, name="fails committing"),
    Worker(lambda: [sr.save(tmp_path, Net(k)) for k in plan], name="writer"),
  ]
  joined(*writers, Worker(restores, writers, name="reader"))
  assert set(seen) <= {0.0, *plan} and seen == sorted(seen)
  assert restored(tmp_path) == plan[-1]
  assert_one_version(tmp_path)
