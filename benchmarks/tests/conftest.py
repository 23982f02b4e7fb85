"""The benchmarks' own checks (not the README's test command: CI runs them in a lane of
their own, `.ci/benchmarks`). 8 CPU devices for the pipeline part, set before jax starts
its backend, as in tests/conftest.py."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
