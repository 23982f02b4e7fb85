"""Raw JAX on modules: the pytree flatten + unflatten of a module, and raw ``jax.jit``.

Every ``sr.Module`` is a JAX pytree, so ``jax.jit(f)(model, x)``, ``jax.tree.map`` and
``jax.grad`` take modules; each such call flattens the module (and unflattens what comes
back) in Python. Three models, each with an equinox and a flax.nnx twin of the same
layers and a raw nested dict of the same arrays:

* ``scan``: a 100-layer ``sr.scan`` class-form stack of ``Linear(16, 16)`` (2 stacked
  Variables; the twins are vmapped ``eqx.nn.Linear`` / ``nnx.Linear``);
* ``list``: a module holding a plain list of 100 ``Linear(16, 16)`` (200 Variables);
* ``blocks``: 8 pre-LN attention blocks (``LayerNorm``, ``MultiHeadAttention``,
  ``LayerNorm``, ``MLP``: 16 Variables each, 128 in all).

Two measurements per model:

* ``flatten_us``: µs per Variable (per leaf) of ``jax.tree.flatten`` followed by
  ``treedef.unflatten`` (min/median/max over samples), for sr, equinox, nnx and the
  dict; ``ratio``: sr's median over equinox's (target ≤ 1.2);
* ``dispatch_us``: µs until ``jax.jit(f)(model, x)`` returns (the compiled call is
  tiny), against ``jax.jit(g)(sr.state(model), x)`` with ``g`` merging the State into
  the same model: the same computation, a State's flatten instead of the module's;
  ``ratio``: module over State (target ≤ 1.2).

Timings are paired and interleaved: each round runs every variant once (a sample is
the mean of ``inner`` calls), in an order that rotates from round to round; the
garbage collector runs before each round and is off during it.

    python -m benchmarks.pytree_flatten           # the full run (about a minute)
    python -m benchmarks.pytree_flatten --quick   # seconds: smaller models, a check only
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import statefulremat as sr

TARGETS = {"flatten": 1.2, "dispatch": 1.2}  # sr / equinox, module / State: at most
WIDTH = 16


def stats(samples: list[float]) -> dict:
  """``min``, ``median`` and ``max`` of ``samples``."""
  return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def paired(
  fns: dict[str, Callable[[], object]], rounds: int, inner: int, *, dispatch: bool = False
) -> dict[str, list[float]]:
  """µs per call of each of ``fns``: one sample per round, the mean of ``inner`` calls;
  every round calls each function in turn, the order rotating from round to round.

  With ``dispatch``, a call is timed until it returns, and its result is then waited
  for (``jax.block_until_ready``) outside the timed span."""
  names = list(fns)
  samples = {name: [] for name in names}
  clock = time.perf_counter
  for r in range(rounds):
    gc.collect()
    gc.disable()
    try:
      shift = r % len(names)
      for name in names[shift:] + names[:shift]:
        fn = fns[name]
        if dispatch:
          spent = 0.0
          for _ in range(inner):
            start = clock()
            out = fn()
            spent += clock() - start
            jax.block_until_ready(out)
        else:
          start = clock()
          for _ in range(inner):
            fn()
          spent = clock() - start
        samples[name].append(spent / inner * 1e6)
    finally:
      gc.enable()
  return samples


# -- the models -----------------------------------------------------------------------


class _Layers(sr.Module):
  def __init__(self, n, *, rngs):
    self.layers = [sr.nn.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(n)]

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


class _Step(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x)), None


class _Block(sr.Module):
  def __init__(self, *, rngs):
    self.ln1 = sr.nn.LayerNorm(WIDTH, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(2, WIDTH, rngs=rngs, keep_rngs=False)
    self.ln2 = sr.nn.LayerNorm(WIDTH, rngs=rngs)
    self.mlp = sr.nn.MLP(WIDTH, 4 * WIDTH, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class _Blocks(sr.Module):
  def __init__(self, n, *, rngs):
    self.blocks = [_Block(rngs=rngs) for _ in range(n)]

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def _sr(kind: str, n: int):
  """``(model, f)``: the sr model and the function the dispatch jits."""
  rngs = sr.Rngs(0)
  if kind == "scan":
    stack = sr.scan(_Step, length=n, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
      rngs=rngs
    )
    return stack, lambda m, x: m(x)[0]
  if kind == "list":
    return _Layers(n, rngs=rngs), lambda m, x: m(x)
  return _Blocks(n, rngs=rngs), lambda m, x: m(x)


def _equinox(kind: str, n: int):
  import equinox as eqx

  keys = jax.random.split(jax.random.key(0), n)
  if kind == "scan":
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(keys)

  class Layers(eqx.Module):
    layers: list

  if kind == "list":
    return Layers([eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys])

  class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
      self.attn = eqx.nn.MultiheadAttention(
        2,
        WIDTH,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=k1,
      )
      self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, activation=jax.nn.gelu, key=k2)

  return Layers([Block(k) for k in keys])


def _nnx(kind: str, n: int):
  from flax import nnx

  if kind == "scan":
    return nnx.vmap(lambda r: nnx.Linear(WIDTH, WIDTH, rngs=r), axis_size=n)(nnx.Rngs(0).split(n))

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(2, WIDTH, decode=False, rngs=rngs, keep_rngs=False)
      self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.fc1 = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
      self.fc2 = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

  class Layers(nnx.Module):
    def __init__(self, items):
      self.layers = nnx.List(items)

  rngs = nnx.Rngs(0)
  if kind == "list":
    return Layers([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(n)])
  return Layers([Block(rngs) for _ in range(n)])


def _as_dict(state) -> dict:
  """The State's arrays as a plain nested dict."""
  out: dict = {}
  for path, value in state.flat().items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def _round_trip(tree) -> Callable[[], object]:
  flatten = jax.tree_util.tree_flatten

  def call():
    leaves, treedef = flatten(tree)
    return treedef.unflatten(leaves)

  return call


def _measure_model(kind: str, n: int, rounds: int, inner: int, dispatch_inner: int) -> dict:
  model, f = _sr(kind, n)
  state = sr.state(model)
  trees = {"sr": model, "equinox": _equinox(kind, n), "nnx": _nnx(kind, n), "dict": _as_dict(state)}
  leaves = {name: len(jax.tree.leaves(tree)) for name, tree in trees.items()}
  samples = paired({name: _round_trip(tree) for name, tree in trees.items()}, rounds, inner)
  flatten_us = {name: stats([s / leaves[name] for s in samples[name]]) for name in trees}

  graphdef = sr.graphdef(model)
  x = jnp.ones((1, 4, WIDTH))
  on_module = jax.jit(f)
  on_state = jax.jit(lambda s, x: f(sr.merge(graphdef, s), x))
  calls = {"module": lambda: on_module(model, x), "state": lambda: on_state(state, x)}
  for call in calls.values():
    jax.block_until_ready(call())  # compile
  dispatch_samples = paired(calls, rounds, dispatch_inner, dispatch=True)
  dispatch_us = {name: stats(s) for name, s in dispatch_samples.items()}
  return {
    "n": n,
    "variables": leaves["sr"],
    "leaves": leaves,
    "flatten_us": flatten_us,
    "flatten_ratio": flatten_us["sr"]["median"] / flatten_us["equinox"]["median"],
    "dispatch_us": dispatch_us,
    "dispatch_ratio": (dispatch_us["module"]["median"] / dispatch_us["state"]["median"]),
  }


def measure(quick: bool = False) -> dict:
  """Per model (``scan``, ``list``, ``blocks``): per-Variable flatten + unflatten µs of
  sr / equinox / nnx / a dict, the sr / equinox ratio, and raw ``jax.jit`` dispatch µs
  on the module and on its State, with their ratio (see the module docstring).

  ``quick`` runs small models and few rounds: a check that it works, not a measurement.
  """
  sizes = {"scan": 4, "list": 4, "blocks": 1} if quick else {"scan": 100, "list": 100, "blocks": 8}
  rounds, inner, dispatch_inner = (3, 2, 2) if quick else (31, 20, 20)
  models = {
    kind: _measure_model(kind, n, rounds, inner, dispatch_inner) for kind, n in sizes.items()
  }
  return {"quick": quick, "targets": TARGETS, "device": jax.devices()[0].platform, "models": models}


def markdown(result: dict) -> str:
  """The result as markdown tables, each ratio against its target (met / missed)."""

  def cell(s):
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"

  def verdict(ratio, target):
    return f"{ratio:.2f}x ({'met' if ratio <= target else 'missed'}, ≤ {target}x)"

  lines = [
    "### Flatten + unflatten per Variable, µs: median (min–max)",
    "",
    "| model | Variables | sr | equinox | nnx | dict | sr / equinox |",
    "|---|---|---|---|---|---|---|",
  ]
  for kind, m in result["models"].items():
    f = m["flatten_us"]
    lines.append(
      f"| {kind} ({m['n']}) | {m['variables']} | {cell(f['sr'])} | "
      f"{cell(f['equinox'])} | {cell(f['nnx'])} | {cell(f['dict'])} | "
      f"{verdict(m['flatten_ratio'], result['targets']['flatten'])} |"
    )
  lines += [
    "",
    "### Raw `jax.jit(f)` dispatch, µs per call: median (min–max)",
    "",
    "| model | on the module | on its State | module / State |",
    "|---|---|---|---|",
  ]
  for kind, m in result["models"].items():
    d = m["dispatch_us"]
    lines.append(
      f"| {kind} ({m['n']}) | {cell(d['module'])} | {cell(d['state'])} | "
      f"{verdict(m['dispatch_ratio'], result['targets']['dispatch'])} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small models, a check only")
  parser.add_argument("--json", help="also write the result to this file")
  cli = parser.parse_args()
  out = measure(quick=cli.quick)
  if cli.json:
    with open(cli.json, "w", encoding="utf-8") as file:
      json.dump(out, file, indent=1)
  print(markdown(out))
