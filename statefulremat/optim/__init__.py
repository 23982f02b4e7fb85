"""The optimiser floor: ``sr.Optimizer`` on optax."""
