"""XLA memory of the gradient through deep stacks: raw JAX vs statefulremat.

The deep-stack model: N layers of Linear W->W + tanh, loss mean(out**2), gradient
over the parameters. Each construction is compiled (never run) and its
``memory_analysis()`` read: temp, argument and output bytes, which are exact and
repeatable. Raw JAX is the hand-written reference: nested ``lax.scan`` with
``jax.checkpoint`` at every level and the parameters passed as xs.

    python benchmarks/remat_memory.py            # W=256, B=4096, N=256, lengths (16, 16)
    python benchmarks/remat_memory.py --quick    # a small configuration
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

import statefulremat as sr


class Dense(sr.Module):
  def __init__(self, width: int, *, rngs: sr.Rngs):
    self.kernel = sr.Param(jax.random.normal(rngs.params(), (width, width)) / width**0.5)
    self.bias = sr.Param(jnp.zeros((width,)))

  def __call__(self, x):
    return jnp.tanh(x @ self.kernel.value + self.bias.value)


def raw_remat_scan(params, x, lengths, policy=None):
  """Nested lax.scan, jax.checkpoint at each level, params as xs (the reference)."""
  folded = jax.tree.map(lambda p: p.reshape(tuple(lengths) + p.shape[1:]), params)

  def layer(h, p):
    return jnp.tanh(h @ p["kernel"] + p["bias"]), None

  def level(d, h, ps):
    if d == len(lengths):
      return layer(h, ps)
    step = jax.checkpoint(
      lambda h, p: level(d + 1, h, p),
      policy=policy if d == len(lengths) - 1 else None,
      prevent_cse=False,
    )
    return jax.lax.scan(step, h, ps)

  return level(0, x, folded)[0]


def memory(fn, *args) -> dict:
  compiled = jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  return {
    "temp": m.temp_size_in_bytes,
    "arguments": m.argument_size_in_bytes,
    "outputs": m.output_size_in_bytes,
  }


def measure(width: int, batch: int, lengths: tuple[int, ...]) -> dict:
  n = math.prod(lengths)
  x = jnp.ones((batch, width))
  stack = sr.vmap(Dense, axis_size=n)(width, rngs=sr.Rngs(0))
  params = {"kernel": stack.kernel.value, "bias": stack.bias.value}

  def raw_loss(params, x):
    return jnp.mean(raw_remat_scan(params, x, lengths) ** 2)

  def sr_remat_scan_loss(model, x):
    return jnp.mean(sr.remat_scan(lambda m, h: m(h), lengths)(model, x) ** 2)

  def sr_scan_remat_loss(model, x):
    body = sr.remat(lambda m, h: (m(h), None), prevent_cse=False)
    out, _ = sr.scan(body, variable_axes={sr.Param: 0})(model, x)
    return jnp.mean(out**2)

  def raw_scan_remat_loss(params, x):
    step = jax.checkpoint(
      lambda h, p: (jnp.tanh(h @ p["kernel"] + p["bias"]), None), prevent_cse=False
    )
    return jnp.mean(jax.lax.scan(step, x, params)[0] ** 2)

  results = {
    "raw remat_scan": memory(jax.grad(raw_loss), params, x),
    "sr.remat_scan": memory(_pure(stack, sr_remat_scan_loss), params, x),
    "raw scan(remat)": memory(jax.grad(raw_scan_remat_loss), params, x),
    "sr.scan(sr.remat)": memory(_pure(stack, sr_scan_remat_loss), params, x),
  }
  return {"width": width, "batch": batch, "layers": n, "lengths": list(lengths), "bytes": results}


def _pure(stack, loss):
  """``params -> grads`` through sr.grad, as a pure function jax.jit can compile."""
  graphdef = sr.graphdef(stack)

  def grad_fn(params, x):
    model = sr.merge(
      graphdef,
      sr.State(
        {"kernel": params["kernel"], "bias": params["bias"]},
        kinds={("kernel",): sr.Param, ("bias",): sr.Param},
      ),
    )
    grads = sr.grad(loss)(model, x)
    return {"kernel": grads["kernel"], "bias": grads["bias"]}

  return grad_fn


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="W=32, B=64, N=16 (4, 4)")
  parser.add_argument("--json", help="also write the results to this JSON file")
  args = parser.parse_args()
  config = (32, 64, (4, 4)) if args.quick else (256, 4096, (16, 16))
  result = measure(*config)
  mib = 2**20
  print(
    f"W={result['width']} B={result['batch']} N={result['layers']} "
    f"lengths={tuple(result['lengths'])} ({jax.devices()[0].platform})"
  )
  print(f"{'construction':20s} {'temp MiB':>10s} {'args MiB':>10s} {'out MiB':>10s}")
  for name, m in result["bytes"].items():
    print(
      f"{name:20s} {m['temp'] / mib:10.2f} {m['arguments'] / mib:10.2f} {m['outputs'] / mib:10.2f}"
    )
  b = result["bytes"]
  print(
    f"ratio sr.remat_scan / raw: temp {b['sr.remat_scan']['temp'] / b['raw remat_scan']['temp']:.4f}"
  )
  print(
    f"ratio sr.scan(remat) / raw: temp "
    f"{b['sr.scan(sr.remat)']['temp'] / b['raw scan(remat)']['temp']:.4f}"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
