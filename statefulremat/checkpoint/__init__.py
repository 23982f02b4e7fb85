"""The checkpoint floor: ``sr.save`` / ``sr.restore`` on orbax-checkpoint."""
