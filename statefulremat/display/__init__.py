"""The display floor: treescope rendering, ``repr``, ``sr.display`` and ``sr.summary``.

Importing it registers the core's renderers (``_hooks``); treescope itself is imported
only when something is drawn."""

from . import _hooks  # noqa: F401  (registers the core's renderers)
