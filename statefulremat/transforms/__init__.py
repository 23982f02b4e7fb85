"""Transforms: one file each, sharing the lifting helper in ``_lift``."""
