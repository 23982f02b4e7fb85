"""Strict defaults for the whole suite, as equinox's own tests use."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rngs():
  import statefulremat as sr

  return sr.Rngs(0)
