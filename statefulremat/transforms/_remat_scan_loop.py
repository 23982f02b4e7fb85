"""What ``sr.remat_scan`` runs: its checked arguments and the nested, rematerialised loop."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp

from ..core._frozen import ALL_SPLIT, ALL_STACKED, EMPTY
from ..core._stacks import Form
from ._class_form import display_name, is_module_class
from ._layers import describe_node
from ._lift import serialised
from ._module_arg import check_loop_call
from ._pattern import class_form, target_repr
from ._pattern_loop import lift_loop
from ._remat_scan_args import AUTO, check_cycles, check_lengths, check_units
from ._rules import Collections, Rules, TransformError
from .memory._carries import check_carries, warn_if_kept, warning_once
from .memory._policy_check import policy_check
from .memory._remat_search import search

# sr.remat_scan's defaults, as options: what sr.pipeline's stages run with.
STAGE_DEFAULTS = dict(
  policy=None,
  carries=None,
  collections=Collections(ALL_STACKED, False, False, ALL_SPLIT),
  prevent_cse=False,
  data_transform=None,
  metadata_params=EMPTY,
)


@dataclasses.dataclass(frozen=True)
class RematScanForm:
  """``sr.remat_scan``'s arguments, checked (``lengths`` resolved from a plan)."""

  what: str
  lengths: tuple | str
  length: int | None
  budget: int | None
  pipeline: Any
  options: dict  # policy, carries, collections, prevent_cse, data_transform, metadata_params
  methods: Sequence[str] | None = None  # a class form's
  init_in_axes: Any = None  # a class form's

  def __post_init__(self):
    if self.pipeline is not None and not hasattr(self.pipeline, "_pipelined"):
      raise TransformError(
        f"{self.what}: pipeline={self.pipeline!r}; it takes sr.PipelineSpec(axis=..., "
        "microbatches=..., schedule=..., repeats=...)."
      )

  def class_form(self, target) -> type | None:
    """The class form over ``target`` (a class, a pattern, a position); None for a function."""
    return class_form(
      target,
      Form.REMAT_SCAN,
      what=self.what,
      rules=lambda: Rules(self.what, self.options["collections"]),
      count=self.count,
      run=self.run,
      position_class=self.position_class,
      methods=self.methods,
      metadata_params=self.options["metadata_params"],
      init_in_axes=self.init_in_axes,
      # The nested layout, for to_linen.
      lengths=self.nesting() if is_module_class(target) else None,
    )

  def position_class(self, position, n: int) -> type:
    """A pattern position's stacked class: its ``n`` layers in one level."""
    what = f"sr.remat_scan({target_repr(position)})"
    form = RematScanForm(
      what, (n,), None, None, None, self.options, self.methods, self.init_in_axes
    )
    return cast(type, form.class_form(position))  # a position is a class

  def nesting(self) -> tuple[int, ...] | None:
    """The layers per level, outermost first; None for lengths="auto"."""
    return None if self.lengths == AUTO else tuple(cast(tuple, self.lengths))

  def count(self, period: int) -> int | None:
    """The layers a class form builds, checked; a pattern's ``lengths`` count its cycles."""
    if self.lengths == AUTO:
      if self.length is None and period == 1:  # a pattern's class form says it for a pattern
        raise TransformError(
          f"{self.what}: the class form with lengths='auto' needs `length=N`, the number "
          "of layers to build (the plan is made at call time, from the carry's shapes)."
        )
      return self.length
    nesting = cast(tuple, self.lengths)
    if period == 1:
      return check_lengths(self.what, nesting, self.length)
    if self.length is not None:  # without length, the pattern's class form says so
      check_lengths(self.what, nesting, None)
      check_cycles(self.what, nesting, self.length, period)
    return self.length

  def run(self, fn: Callable, period: int) -> Callable:
    """A class form's method ``fn`` as a function form (a pattern's lengths count cycles)."""
    if period == 1:
      return self.function_form(fn, self.count(1))
    nesting = self.nesting()
    return self.function_form(fn, None if nesting is None else math.prod(nesting))

  def function_form(self, fn: Callable, layers: int | None) -> Callable:
    """The function form over ``fn``."""
    what = f"sr.remat_scan({display_name(fn)})"
    if self.pipeline is not None:  # sr.PipelineSpec runs each stage through remat_scan
      run = self.pipeline._pipelined(
        fn,
        what=what,
        lengths=self.lengths,
        layers=layers,
        memory_budget=self.budget,
        options=self.options,
      )
      return warning_once(run, what) if self.options["carries"] == "offload" else run
    return remat_scan_function(fn, self.lengths, layers, self.budget, what=what, **self.options)


def remat_scan_function(
  fn: Callable,
  lengths: tuple | str,
  n: int | None,
  budget: int | None,
  *,
  what,
  policy,
  carries,
  prevent_cse,
  data_transform,
  metadata_params,
  collections,
) -> Callable:
  rules = Rules(what, collections)
  auto = lengths == AUTO or policy == AUTO
  offload = check_carries(what, carries, planned=True)
  # The innermost level's policy, checked once per trace (an "auto" one is the block's names).
  check = policy_check(None if policy == AUTO else policy, what)
  plans: dict = {}  # planned: one plan per (module structure, N, argument shapes)

  def planned(module, lifted, count, carry, args, kwargs) -> tuple:
    """``(lengths, innermost policy, offload)``, as given or planned ("auto")."""
    if not auto:
      return lengths, policy, offload
    key = (lifted, count, avals(carry), avals(args), avals(kwargs))
    chosen = plans.get(key)
    if chosen is None:
      chosen = plans[key] = search(
        module,
        carry,
        lambda layer, c: fn(layer, c, *args, **kwargs),
        budget,
        policy,
        carries,
        lengths=None if lengths == AUTO else lengths,
      )
    return chosen.lengths, chosen.policy, chosen.carries == "offload"

  @functools.wraps(fn)
  def wrapper(module, carry, *args, **kwargs):
    usage = "sr.remat_scan(f, lengths=...)(stack, carry)"
    check_loop_call(what, usage, module, carry, args, kwargs)
    loop = lift_loop(
      module,
      what,
      rules,
      metadata_params,
      "f(module, carry) -> carry",
      fallback=n,
      data_transform=data_transform,
    )
    if n is not None:
      check_units(what, n, lengths, loop)
    nesting, innermost, offloading = planned(module, loop.lifted, loop.length, carry, args, kwargs)

    def body(layer, c, _):
      out = fn(layer, c, *args, **kwargs)
      refuse_carry_and_more(what, c, out)
      return out, None

    def run(carry):
      carry, _ = loop.loop(
        body,
        carry,
        None,
        lengths=nesting,
        remat=True,
        policy=innermost,
        prevent_cse=prevent_cse,
        offload=offloading,
      )
      return carry, loop.changed, loop.made

    if offloading:
      warn_if_kept(what)

    # Under a policy check the loop runs in a jaxpr first: its results come out
    # through the returned values, never as that trace's tracers left on `loop`.
    carry, loop.changed, loop.made = run(carry) if check is None else check.run(run, carry)
    loop.finish()
    return carry

  return serialised(wrapper)


def refuse_carry_and_more(what: str, carry, out) -> None:
  """Raises if the body returned ``(carry, something)`` where remat_scan takes the carry alone."""
  if jax.tree.structure(out) == jax.tree.structure(carry):
    return
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    return  # another change of structure: the loop's carry check says where
  if jax.tree.structure(out[0]) != jax.tree.structure(carry):
    return
  raise TransformError(
    f"{what}: the body returned a pair (carry, {describe_node(out[1])}) where "
    "sr.remat_scan's body returns the carry alone: each layer's output is the next "
    "layer's input. Fix: return only the carry; keep an auxiliary output with "
    "`self.sow(sr.Intermediate, 'name', value)` (it comes out stacked per layer), or "
    "use sr.scan (wrapped in sr.remat for the memory), whose body returns (carry, ys)."
  )


def avals(tree):
  """The shapes and dtypes of ``tree``'s leaves: what a plan is keyed on."""
  return tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree))
