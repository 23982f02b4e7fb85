"""Doctests run with rank promotion raising, like the tests."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
