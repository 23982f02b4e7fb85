"""Strict defaults for the whole suite, as equinox's own tests use, and 8 CPU devices
for the sharding tests (the flag must be set before jax is imported)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rngs():
  import statefulremat as sr

  return sr.Rngs(0)
