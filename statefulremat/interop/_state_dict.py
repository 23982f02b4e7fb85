r"""Flat state dicts <-> our modules: ``from_state_dict`` and ``to_state_dict``.

A state dict is a flat ``{name: array}`` mapping, names dot-joined with list indices
as numbers (``layers.3.linear.kernel``): what ``safetensors.numpy.load_file`` returns
and ``save_file`` takes, and how PyTorch names a module's parameters. With
``layout="torch"`` the arrays are in PyTorch's layout and names: for our ``sr.nn``
layers, ``Linear.weight`` is ``(out, in)`` where our ``kernel`` is ``(in, out)``,
``Conv.weight`` is ``(out, in, *window)`` where ours is ``(*window, in, out)``, and
``weight`` / ``bias`` (``running_mean`` / ``running_var``) of Linear, Conv, Embedding,
LayerNorm, RMSNorm and BatchNorm are our ``kernel`` / ``embedding`` / ``scale``,
``bias`` (``mean`` / ``var``). Other variables keep their names and layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core._stacks import stack_info
from ..nn import BatchNorm, Conv, Embed, LayerNorm, Linear, RMSNorm
from ._hints import report_unmatched
from ._names import Source, answers, array_of, fits, layer_note, load, made_names, match
from ._paths import Entry, chosen_entries, select_collections
from ._report import Problems, array_str

_LAYOUTS = ("jax", "torch")
# our layer class -> {our variable name: PyTorch's name}
_TORCH_NAMES = {
  Linear: {"kernel": "weight"},
  Conv: {"kernel": "weight"},
  Embed: {"embedding": "weight"},
  LayerNorm: {"scale": "weight"},
  RMSNorm: {"scale": "weight"},
  BatchNorm: {"scale": "weight", "mean": "running_mean", "var": "running_var"},
}
_FIX_NAMES = (
  "name the state dict's entries after our paths (`layers.0.linear.kernel`; "
  "a list of layers `blocks.0.…` … `blocks.{L-1}.…` fills our stack at "
  "`blocks`), or map them with rename={r'^model\\.': '', ...}."
)
_FIX_UNUSED = (
  "every entry needs a variable of ours: add the layer to our model, or "
  "leave the entry out (a callable rename may return None for it, e.g. "
  "PyTorch's `num_batches_tracked`)."
)
_FIX_SHAPE = (
  "build our layers with the source model's sizes; with PyTorch weights, "
  "pass layout='torch' (Linear and Conv weights are transposed)."
)
_FIX_DTYPE = (
  "dtypes must match exactly (no silent casts): cast the arrays "
  "(`{k: v.astype(...) for k, v in flat.items()}`) or build our model with "
  "that param_dtype."
)


def _torch_word(e: Entry) -> str | None:
  """PyTorch's name for the variable where its layer names it otherwise (``weight``
  for a Linear's ``kernel``); None where it keeps ours."""
  for cls in type(e.owner).__mro__:
    if stack_info(cls) is not None:  # a stack's class: look at its layer class
      continue
    if cls in _TORCH_NAMES:
      return _TORCH_NAMES[cls].get(e.path[-1])
    if cls.__module__.split(".")[0] == "statefulremat":
      return None  # one of our other layers (ConvTranspose & co.): our names
  return None


def _torch_name(e: Entry, layer: int | None) -> str:
  """``e.dotted(layer)`` with PyTorch's name for the variable where it has its own."""
  name, word = e.dotted(layer), _torch_word(e)
  return name if word is None else name[: len(name) - len(str(e.path[-1]))] + word


def _torch_axes(e: Entry, layer: int | None) -> tuple | None:
  """``axes`` such that our array (one layer's, with ``layer``) is
  ``np.transpose(torch's, axes)``: for a Linear or Conv kernel, ``(out, in,
  *window)`` -> ``(*window, in, out)``; None for the variables PyTorch lays out as we do."""
  if e.path[-1] != "kernel" or _torch_word(e) is None:
    return None
  axes = (*range(2, len(e.layer_shape())), 1, 0)
  if e.axis is not None and layer is None:  # the whole stack: its layer axis stays
    shifted = [k if k < e.axis else k + 1 for k in axes]
    axes = (*shifted[: e.axis], e.axis, *shifted[e.axis :])
  return axes


def _check(layout, flat, what: str) -> None:
  if layout not in _LAYOUTS:
    raise ValueError(
      f"{what}: layout= is 'jax' (our names and layouts) or 'torch' (PyTorch's), got {layout!r}."
    )
  if flat is not None and (
    not isinstance(flat, Mapping) or not all(isinstance(k, str) for k in flat)
  ):
    raise TypeError(
      f"{what} takes a flat mapping of dot-joined names to arrays, "
      "{'layers.0.kernel': array, ...} (what safetensors.numpy.load_file returns), "
      f"got {type(flat).__name__}"
      + (" with keys that are not strings" if isinstance(flat, Mapping) else "")
      + ". Flatten nested dicts first; for nnx or linen, use from_nnx / from_linen."
    )


def from_state_dict(
  model, flat: Mapping, *, rename: Any = None, layout: str = "jax", collections: Any = None
):
  r"""Loads a flat state dict ``{name: array}`` into ``model``, in place; returns it.

  Names are dot-joined paths with list indices as numbers (``layers.0.kernel``), as
  PyTorch and ``safetensors.numpy.load_file`` give them; ``rename`` maps them to
  ours first. A stacked variable (``blocks.linear.kernel``, the stack at ``blocks``)
  takes either the stacked array or a list of layers at the stack's path
  (``blocks.0.linear.kernel`` … ``blocks.{L-1}.linear.kernel``). With
  ``layout="torch"`` the arrays are PyTorch's: Linear and Conv weights are
  transposed to ours, and PyTorch's names of Linear, Conv, Embedding, LayerNorm,
  RMSNorm and BatchNorm (``weight``, ``running_mean``, ...) are accepted besides ours
  (see ``sr.interop``). Shapes (after the transposition) and dtypes must match
  exactly.

  Everything is checked before anything is written: an entry that fills nothing,
  a variable of ours left unfilled, two entries for one variable, or a shape or
  dtype that differs raises ``sr.StateMismatchError`` naming each (with the nearest names),
  and leaves the model unchanged.

  Args:
    model: our module.
    flat: ``{name: array}`` (numpy or JAX arrays).
    rename: the state dict's name to ours: a callable (returning None leaves the
      entry out) or a mapping of regular expressions to replacements, applied in
      order like ``re.sub``; e.g. ``{r"^model\.": ""}``.
    layout: ``"jax"`` (our names and layouts) or ``"torch"``.
    collections: fill only these collections (names or kinds). Default: every
      non-RNG variable of ours.

  Returns:
    ``model``.

  >>> import numpy as np, statefulremat as sr
  >>> torch_linear = {"weight": np.arange(6.0, dtype=np.float32).reshape(3, 2),
  ...                 "bias": np.zeros(3, np.float32)}  # torch.nn.Linear(2, 3)
  >>> ours = sr.interop.from_state_dict(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)),
  ...                                   torch_linear, layout="torch")
  >>> ours.kernel.value.tolist()  # (in, out)
  [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
  """
  what = "sr.interop.from_state_dict"
  _check(layout, flat, what)
  problems = Problems(what, "the model is unchanged")
  ours = chosen_entries(model, select_collections(collections, what), what)
  torch = layout == "torch"

  def names(e: Entry, layer: int | None) -> list[str]:
    out = [e.dotted(layer)]
    if torch and _torch_name(e, layer) != out[0]:
      out.append(_torch_name(e, layer))
    return out

  sources = [Source(name, name, f"state dict `{name}`", value) for name, value in flat.items()]
  found = match(ours, sources, names, rename, problems, "state dict")

  def missing(e: Entry) -> str:
    renamed = "entry renamed to " if rename is not None else ""
    return f"the state dict has no {renamed}{answers(e, names)}."

  def value(e: Entry, s: Source, layer: int | None, problems: Problems):
    """``s``'s array in our layout (one layer's with ``layer``), or None after adding
    a problem."""
    value = array_of(e, s, layer, s.leaf, problems)
    if value is None:
      return None
    axes = _torch_axes(e, layer) if torch else None
    note, expected = layer_note(e, layer), None
    if axes is not None:
      ours = e.shape if layer is None else e.layer_shape()
      expected = tuple(ours[k] for k in np.argsort(axes))
      note += f", in PyTorch's layout {expected}"
    if not fits(e, s, layer, value, problems, (_FIX_SHAPE, _FIX_DTYPE), note, expected):
      return None
    value = jnp.asarray(value)
    return value if axes is None else jnp.transpose(value, axes)

  report_unmatched(found, missing, array_str, (_FIX_NAMES, _FIX_UNUSED))
  return load(model, found, value)


def to_state_dict(
  model,
  *,
  rename: Any = None,
  layout: str = "jax",
  unstack: bool | None = None,
  collections: Any = None,
) -> dict:
  r"""``model``'s variables as a flat state dict ``{name: numpy array}``.

  The reverse of ``from_state_dict``: names are our paths dot-joined
  (``layers.0.kernel``), arrays are numpy copies, ready for
  ``safetensors.numpy.save_file``. With ``layout="torch"``, PyTorch's names and
  layouts for our Linear, Conv, Embed, LayerNorm, RMSNorm and BatchNorm
  (``weight (out, in)``, ``running_mean``, ...; see ``sr.interop``), and each stack
  as a list of layers, as a PyTorch model keeps it.

  Args:
    model: our module.
    rename: here the names are made, so it goes from ours (in the chosen layout's
      names, ``blocks.3.linear.weight`` with ``"torch"``) to the name written: a
      callable (None leaves the variable out) or a mapping of regular expressions
      to replacements, applied in order like ``re.sub``.
    layout: ``"jax"`` or ``"torch"``.
    unstack: each stacked variable as a list of layers (``blocks.0.…`` …
      ``blocks.{L-1}.…``) rather than one stacked array. Default: with
      ``layout="torch"`` only.
    collections: only these collections (names or kinds); default all but RNG state.

  Returns:
    a dict of numpy arrays.

  >>> import statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=2)
  >>> flat = sr.interop.to_state_dict(Stack(3, 4, rngs=sr.Rngs(0)), layout="torch",
  ...                                 rename={r"^": "layers."})
  >>> {name: value.shape for name, value in flat.items()}
  {'layers.0.bias': (4,), 'layers.1.bias': (4,),
   'layers.0.weight': (4, 3), 'layers.1.weight': (4, 3)}
  """
  what = "sr.interop.to_state_dict"
  _check(layout, None, what)
  problems = Problems(what, "no state dict was returned")
  ours = chosen_entries(model, select_collections(collections, what), what)
  torch = layout == "torch"
  unstack = torch if unstack is None else unstack

  named = _torch_name if torch else Entry.dotted
  names = made_names(ours, unstack, named, rename, problems, "state dict entry", nested=False)
  problems.raise_if_any()
  out = {}
  for e, layer, name in names:
    value = np.asarray(e.var.value)
    axes = _torch_axes(e, layer) if torch else None
    if layer is not None:
      value = np.take(value, layer, axis=e.axis)
    if axes is not None:
      value = np.ascontiguousarray(np.transpose(value, np.argsort(axes)))
    out[name] = value
  return out
