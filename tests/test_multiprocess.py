"""Several processes for real: 2 local processes with 4 CPU devices each, joined by
``jax.distributed.initialize`` on 127.0.0.1 with gloo collectives, train a sharded
``remat_scan`` stack on the 8 global devices (Explicit axes), save one checkpoint
from both, restore it in 2 processes and in 1, and restore a 1-process checkpoint in
2 — every loss equal to this one process's on its own 8 devices. Both processes also
save in the background (``blocking=False``), and that checkpoint restores too.

The program each process runs is ``tests/multiprocess_worker.py``.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import statefulremat as sr
from tests import multiprocess_worker as worker

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 150  # seconds for one multi-process run; each process also times out itself


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def gloo_available() -> bool:
  try:
    jax.config.jax_cpu_collectives_implementation  # noqa: B018
    return True
  except AttributeError:
    return False


pytestmark = pytest.mark.skipif(
  not gloo_available(),
  reason="this jaxlib has no gloo CPU collectives, which the "
  "processes need to run one program together",
)


def run_processes(tmp_path, name: str, *args: str, n: int = 2) -> list[dict]:
  """Runs the worker in ``n`` processes; returns each one's JSON result."""
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    "PYTHONPATH": str(ROOT),
  }
  port = free_port()
  outs = [tmp_path / f"{name}-{i}.json" for i in range(n)]
  logs = [open(tmp_path / f"{name}-{i}.log", "w") for i in range(n)]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(ROOT / "tests" / "multiprocess_worker.py"),
        "--port",
        str(port),
        "--process-id",
        str(i),
        "--num-processes",
        str(n),
        "--out",
        str(outs[i]),
        *args,
      ],
      env=env,
      stdout=logs[i],
      stderr=subprocess.STDOUT,
    )
    for i in range(n)
  ]
  try:
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
  finally:
    for p in procs:
      p.kill()
    for log in logs:
      log.close()
  text = "\n".join(
    f"--- process {i}:\n" + (tmp_path / f"{name}-{i}.log").read_text()[-3000:] for i in range(n)
  )
  assert codes == [0] * n, text
  return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def reference():
  """This process on its own 8 devices: losses of steps 0-4, with a checkpoint at 3."""
  mesh = worker.mesh()
  with jax.set_mesh(mesh):
    model, opt = worker.build(mesh)
    first = worker.run_steps(model, opt, mesh, 0, 3)
    state = sr.clone(opt)
    rest = worker.run_steps(model, opt, mesh, 3, 2)
  return first, rest, state


def test_two_processes_train_save_and_restore_in_two_and_in_one(tmp_path, reference):
  first, rest, state_at_3 = reference
  two = str(tmp_path / "saved-by-2")
  two_async = str(tmp_path / "saved-by-2-in-the-background")
  one = str(tmp_path / "saved-by-1")
  mesh = worker.mesh()
  with jax.set_mesh(mesh):
    sr.save(one, state_at_3)

  runs = run_processes(
    tmp_path,
    "train-and-resume",
    "--steps",
    "3",
    "--save",
    two,
    "--save-in-background",
    two_async,
    "--resume",
    "2",
    two,
    two_async,
    one,
  )
  assert [r["devices"] for r in runs] == [8, 8]
  assert [r["local_devices"] for r in runs] == [4, 4]
  for r in runs:  # every process sees the same (global) losses
    np.testing.assert_allclose(r["losses"], first, rtol=1e-5)
    np.testing.assert_allclose(r["resumed"][two], rest, rtol=1e-5)  # written by 2
    np.testing.assert_allclose(r["resumed"][two_async], rest, rtol=1e-5)
    np.testing.assert_allclose(r["resumed"][one], rest, rtol=1e-5)  # written by 1

  # The 2-process checkpoint restores in this one process and continues the same.
  with jax.set_mesh(mesh):
    model, opt = worker.build(mesh)
    sr.restore(two, opt)
    np.testing.assert_allclose(worker.run_steps(model, opt, mesh, 3, 2), rest, rtol=1e-5)
