"""MaxText's remat presets, by name, and its ``custom`` policy of named tensors.

Each preset is MaxText's ``remat_policy`` of the same name (its ``decoders.py``): a list
of the canonical ``checkpoint_name`` names that ``sr.nn``'s layers give (``query_proj``,
``context``, ``mlpwi``, ...) to keep on the device or offload to host memory.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from ..core._errors import TransformError
from ..transforms.memory import CUSTOM_CHOICES as _CHOICES
from ..transforms.memory import Policy, custom_policy

_QKV = ("query_proj", "value_proj", "key_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")


PRESETS: dict[str, Policy] = {}  # by name, in the order of `preset`'s table


def _preset(name: str, saved: tuple[str, ...] = (), offloaded: tuple[str, ...] = ()) -> Policy:
  PRESETS[name] = Policy(f"sr.policies.{name}", saved, offloaded)
  return PRESETS[name]


full = _preset("full")
minimal = _preset("minimal", _MINIMAL)
minimal_with_context = _preset("minimal_with_context", (*_MINIMAL, "context"))
save_dot_with_context_except_mlp = _preset(
  "save_dot_with_context_except_mlp", (*_QKV, "context", "out_proj")
)
save_dot_except_mlpwi = _preset("save_dot_except_mlpwi", (*_QKV, "out_proj", "mlpwo"))
save_dot_except_mlp = _preset("save_dot_except_mlp", (*_QKV, "out_proj"))
save_qkv_proj = _preset("save_qkv_proj", _QKV)
save_out_proj = _preset("save_out_proj", ("out_proj",))
# MaxText offloads the three projections here, not a fused qkv_proj.
qkv_proj_offloaded = _preset("qkv_proj_offloaded", (), ("query_proj", "value_proj", "key_proj"))
minimal_offloaded = _preset("minimal_offloaded", (), _MINIMAL)


def preset(name: str) -> Policy:
  """The preset remat policy called ``name``, as MaxText's ``remat_policy=name``.

  The presets are also this module's attributes (``sr.policies.minimal``):

  ==================================== =============================================================
  preset                               keeps (every other value is recomputed)
  ==================================== =============================================================
  ``full``                             nothing
  ``minimal``                          ``query_proj``, ``value_proj``, ``key_proj``, ``qkv_proj``,
                                       ``out_proj``, ``mlpwi_0``, ``mlpwi_1``, ``mlpwi``, ``mlpwo``
  ``minimal_with_context``             ``minimal``'s names and ``context``
  ``save_dot_with_context_except_mlp`` ``query_proj``, ``value_proj``, ``key_proj``, ``qkv_proj``,
                                       ``context``, ``out_proj``
  ``save_dot_except_mlpwi``            ``query_proj``, ``value_proj``, ``key_proj``, ``qkv_proj``,
                                       ``out_proj``, ``mlpwo``
  ``save_dot_except_mlp``              ``query_proj``, ``value_proj``, ``key_proj``, ``qkv_proj``,
                                       ``out_proj``
  ``save_qkv_proj``                    ``query_proj``, ``value_proj``, ``key_proj``, ``qkv_proj``
  ``save_out_proj``                    ``out_proj``
  ``qkv_proj_offloaded``               offloads ``query_proj``, ``value_proj``, ``key_proj`` to host
  ``minimal_offloaded``                offloads ``minimal``'s names to host
  ==================================== =============================================================

  Args:
    name: the preset's name, one of the table's (``"minimal"``).

  Returns:
    The preset's ``Policy``, the object ``sr.policies.<name>`` is; pass it as
    ``policy=`` to ``sr.remat``, ``sr.remat_scan`` or ``sr.pipeline``.

  Raises:
    TypeError: ``name`` is not a string.
    sr.TransformError: no preset has that name (a ``ValueError``); the message names the
      nearest.

  >>> import statefulremat as sr
  >>> sr.policies.preset("minimal") is sr.policies.minimal
  True
  >>> sr.policies.preset("save_out_proj").saved
  ('out_proj',)
  """
  if not isinstance(name, str):
    raise TypeError(
      f"sr.policies.preset({name!r}): the preset's name is a string, got "
      f"{type(name).__name__}. Fix: one of {', '.join(map(repr, PRESETS))}."
    )
  if name not in PRESETS:
    close = difflib.get_close_matches(name, list(PRESETS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise TransformError(
      f"sr.policies.preset({name!r}): there is no such preset; {hint}The presets: "
      f"{', '.join(map(repr, PRESETS))}. For your own list of names, "
      "`sr.policies.custom({name: 'remat' | 'device' | 'offload'})`."
    )
  return PRESETS[name]


def custom(tensors: Mapping[str, str]) -> Policy:
  """A remat policy that treats each named tensor as ``tensors`` says, as MaxText's custom.

  ``tensors`` maps names (``checkpoint_name``'s) to ``"device"`` (saved in device memory),
  ``"offload"`` (moved to host memory, ``pinned_host``, for the backward pass) or
  ``"remat"`` (recomputed, as is every value the mapping does not name). Built on
  ``jax.checkpoint_policies.save_and_offload_only_these_names``. On a backend that
  offloads nothing (CPU) the remat warns that offloaded values stay on the device.
  ``"attention_out"`` is taken as ``"context"``, the name ``sr.nn.MultiHeadAttention``
  gives attention's output before its output projection (MaxText's name).

  Args:
    tensors: ``{checkpoint name: choice}``, each choice ``"device"``, ``"offload"`` or
      ``"remat"``.

  Returns:
    The ``Policy``; pass it as ``policy=`` to ``sr.remat``, ``sr.remat_scan`` or
    ``sr.pipeline``. Its ``saved`` and ``offloaded`` list the names of each choice.

  Raises:
    TypeError: ``tensors`` is not a mapping, or a key is not a string.
    sr.TransformError: a choice is not one of the three (a ``ValueError``); the message
      names the entry.

  >>> import statefulremat as sr
  >>> policy = sr.policies.custom({"query_proj": "offload", "mlpwo": "device"})
  >>> policy.saved, policy.offloaded
  (('mlpwo',), ('query_proj',))
  >>> policy
  sr.policies.custom({'query_proj': 'offload', 'mlpwo': 'device'})
  """
  if not isinstance(tensors, Mapping):
    raise TypeError(
      f"sr.policies.custom({tensors!r}): takes a dict from checkpoint names to "
      f"'remat', 'device' or 'offload', got {type(tensors).__name__}. Fix: e.g. "
      "`sr.policies.custom({'query_proj': 'offload', 'mlpwo': 'device'})`."
    )
  for name, choice in tensors.items():
    if not isinstance(name, str):
      raise TypeError(
        f"sr.policies.custom: the entry {name!r}: {choice!r} is keyed by a "
        f"{type(name).__name__}; the keys are the names `jax.ad_checkpoint."
        "checkpoint_name` gives values. Fix: key it by such a name, e.g. "
        f"{{'mlpwo': {choice!r}}}."
      )
    if choice not in _CHOICES:
      close = difflib.get_close_matches(str(choice), _CHOICES, n=1)
      fix = close[0] if close else "device"
      raise TransformError(
        f"sr.policies.custom: the entry {name!r}: {choice!r} is not a choice; each "
        "name maps to 'remat' (recompute it), 'device' (save it on the device) or "
        f"'offload' (save it in host memory). Fix: {{{name!r}: {fix!r}}}."
      )
  return custom_policy(tensors)
