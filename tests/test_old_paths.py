"""What 0.1 wrote before the modules moved into floor folders still loads (issue 23).

``tests/data/v0_1`` was written by statefulremat 0.1 (commit b1f53de): a pickled model
(whose classes it names by the old module paths, ``statefulremat._kinds`` …), an
``sr.save`` checkpoint of a 3-layer ``remat_scan`` stack, and the stack's values.
"""

import pathlib
import pickle
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

DATA = pathlib.Path(__file__).parent / "data" / "v0_1"


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.lin = sr.nn.Linear(2, 2, rngs=rngs)
    self.norm = sr.nn.BatchNorm(2, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.lin(x))


def test_a_pickle_written_by_0_1_loads():
  raw = (DATA / "model.pkl").read_bytes()
  assert b"statefulremat._kinds" in raw and b"statefulremat._containers" in raw
  model = pickle.loads(raw)
  assert isinstance(model, sr.ModuleList)
  assert isinstance(model[0], sr.nn.Linear) and isinstance(model[0].kernel, sr.Param)
  assert isinstance(model[1], sr.nn.BatchNorm) and isinstance(model[1].mean, sr.BatchStat)
  np.testing.assert_array_equal(model[1].mean.value, np.arange(4.0))
  fresh = sr.nn.Linear(3, 4, rngs=sr.Rngs(0))
  np.testing.assert_array_equal(model[0].kernel.value, fresh.kernel.value)
  assert model[0](jnp.ones((1, 3))).shape == (1, 4)
  again = pickle.loads(pickle.dumps(model))  # and pickles under the new paths
  np.testing.assert_array_equal(again[1].mean.value, model[1].mean.value)


@pytest.mark.parametrize("lengths", [(3,), (2, 2)])
def test_a_checkpoint_written_by_0_1_restores_into_any_lengths(tmp_path, lengths):
  path = tmp_path / "ckpt"
  shutil.copytree(DATA / "stack_ckpt", path)
  stack = sr.remat_scan(Block, length=3, lengths=lengths)(rngs=sr.Rngs(1))
  sr.restore(path, stack)
  expected = np.load(DATA / "expected.npz")
  flat = sr.state(stack).flat()
  for name in expected.files:
    np.testing.assert_array_equal(flat[tuple(name.split("/"))], expected[name])


def test_old_module_paths_are_the_new_modules_not_copies():
  import importlib

  old = importlib.import_module("statefulremat._transforms._scan")
  new = importlib.import_module("statefulremat.transforms._scan")
  assert old is new and old.scan is sr.scan
  assert importlib.import_module("statefulremat._checkpoint").save is sr.save
