"""Transforms: one file each, sharing the lifting kernel in ``_lift``. The folders above
(nn/) reach them through the names given here."""

from ._scan import scan as scan
