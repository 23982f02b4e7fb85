"""The remat planner against XLA on real blocks: ``python -m benchmarks --part planner``.

    python -m benchmarks.planner [--quick] [--out DIR]

For every block below, stacked with ``sr.remat_scan``'s class form, ``sr.plan_remat``
plans the stack without a budget; then its pick and the next candidates in its ranking
(``plan.candidates``, best first) are compiled, and each one's predicted temp bytes are
set against XLA's (``memory_analysis()`` of the gradient with respect to every
parameter: exact and repeatable). The blocks (float32; batch 8, seq 128, width 128
unless said):

* ``MHA``: a pre-LN GPT block, multi-head causal self-attention (8 heads) and an MLP
  (hidden 4x); ``MHA + dropout``: the same with dropout 0.1 in both (a stream split
  per layer); ``GQA`` / ``GQA + dropout``: 8 query heads sharing 2 key/value heads;
* ``MLP``: LayerNorm and an MLP (width 256, hidden 1024) with a residual;
* ``conv``: Conv 3x3, GroupNorm, ReLU, Conv 3x3, residual (32 channels, 32 x 32,
  batch 8);
* ``pattern``: Gemma-3-like cycles of five local (sliding window 32) and one global
  attention block (4 query heads, 1 key/value head, a gated GELU MLP, RMSNorms): 24
  layers, 4 cycles, batch 4;
* ``Dense + tanh``: the deep-stack suite's block (width 256, batch 4096), 97 layers.

Reported per row: the block, the plan's unit count (layers, or cycles), the
candidate's ``lengths`` and policy, its evaluations, predicted and measured temp and
the error ``(predicted - measured) / measured``; per block, the planning seconds. Also
the issue's case: the pattern stack planned under ``memory_budget="80MiB"`` (the pick,
XLA's figure, whether it fits). Target: ``|error| <= 10 %`` on every row, and the
budget's pick fits (asserted after the files are written). Writes ``planner.json`` and
``planner.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/planner.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import statefulremat as sr  # noqa: E402
from benchmarks.provenance import part_main, provenance  # noqa: E402
from statefulremat.transforms.memory._remat_plan import format_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.10  # |predicted - measured| / measured, on every row
FULL = {"batch": 8, "seq": 128, "width": 128, "layers": 24, "next": 4, "budget": "80MiB"}
QUICK = {"batch": 2, "seq": 16, "width": 32, "layers": 6, "next": 2, "budget": None}


class GPT(sr.Module):
  """A pre-LN transformer block: causal self-attention, then an MLP."""

  def __init__(self, width, heads, kv_heads=None, dropout=0.0, *, rngs):
    self.attn_norm = sr.nn.LayerNorm(width, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(
      heads, width, num_kv_heads=kv_heads, dropout_rate=dropout, deterministic=False, rngs=rngs
    )
    self.mlp_norm = sr.nn.LayerNorm(width, rngs=rngs)
    self.mlp = sr.nn.MLP(width, 4 * width, dropout_rate=dropout, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x), is_causal=True)
    return x + self.mlp(self.mlp_norm(x))


class MLPBlock(sr.Module):
  def __init__(self, width, *, rngs):
    self.norm = sr.nn.LayerNorm(width, rngs=rngs)
    self.mlp = sr.nn.MLP(width, 4 * width, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


class ConvBlock(sr.Module):
  def __init__(self, channels, *, rngs):
    self.conv1 = sr.nn.Conv(channels, channels, (3, 3), rngs=rngs)
    self.norm = sr.nn.GroupNorm(channels, num_groups=8, rngs=rngs)
    self.conv2 = sr.nn.Conv(channels, channels, (3, 3), rngs=rngs)

  def __call__(self, x):
    return x + self.conv2(jax.nn.relu(self.norm(self.conv1(x))))


class GemmaBlock(sr.Module):
  """Gemma 3's block, as tutorial 9 writes it: local (a sliding window) or global."""

  def __init__(self, width, *, window, rope_base, rngs):
    self.window = window
    self.attn_norm = sr.nn.RMSNorm(width, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(
      4, width, num_kv_heads=1, rope_base=rope_base, use_bias=False, rngs=rngs
    )
    self.attn_out_norm = sr.nn.RMSNorm(width, rngs=rngs)
    self.mlp_norm = sr.nn.RMSNorm(width, rngs=rngs)
    self.gate = sr.nn.Linear(width, 4 * width, use_bias=False, rngs=rngs)
    self.up = sr.nn.Linear(width, 4 * width, use_bias=False, rngs=rngs)
    self.down = sr.nn.Linear(4 * width, width, use_bias=False, rngs=rngs)
    self.mlp_out_norm = sr.nn.RMSNorm(width, rngs=rngs)

  def __call__(self, x):
    mask = None
    if self.window is not None:
      p = jnp.arange(x.shape[-2])
      mask = (p[:, None] - p[None, :] < self.window)[None, None]
    x = x + self.attn_out_norm(self.attn(self.attn_norm(x), mask=mask, is_causal=True))
    h = self.mlp_norm(x)
    return x + self.mlp_out_norm(self.down(jax.nn.gelu(self.gate(h)) * self.up(h)))


def _dense_tanh(layer, h):
  return jnp.tanh(layer(h))


def _abstract(target, n: int, *args, **kwargs):
  """The stack's ``sr.eval_shape``: nothing is initialised."""
  stack = sr.remat_scan(target, length=n, lengths=(n,))
  return sr.eval_shape(lambda: stack(*args, rngs=sr.Rngs(0, dropout=1), **kwargs))


def blocks(cfg: dict):
  """``(name, stack, carry, body)`` per block (``body`` None: ``layer(carry)``)."""
  b, s, w, n = cfg["batch"], cfg["seq"], cfg["width"], cfg["layers"]
  tokens = jax.ShapeDtypeStruct((b, s, w), jnp.float32)
  heads = max(2, w // 16)
  yield "MHA", _abstract(GPT, n, w, heads), tokens, None
  yield "MHA + dropout", _abstract(GPT, n, w, heads, dropout=0.1), tokens, None
  yield "GQA", _abstract(GPT, n, w, heads, kv_heads=2), tokens, None
  yield "GQA + dropout", _abstract(GPT, n, w, heads, kv_heads=2, dropout=0.1), tokens, None
  wide = jax.ShapeDtypeStruct((b, s, 2 * w), jnp.float32)
  yield "MLP", _abstract(MLPBlock, 2 * n, 2 * w), wide, None
  image = jax.ShapeDtypeStruct((b, s // 4, s // 4, w // 4), jnp.float32)
  yield "conv", _abstract(ConvBlock, n, w // 4), image, None
  local = functools.partial(GemmaBlock, w, window=max(2, s // 4), rope_base=10_000.0)
  glob = functools.partial(GemmaBlock, w, window=None, rope_base=1_000_000.0)
  pattern = (local,) * 5 + (glob,)
  gemma_carry = jax.ShapeDtypeStruct((max(1, b // 2), s, w), jnp.float32)
  yield "pattern", _abstract(pattern, n), gemma_carry, None
  dense = sr.eval_shape(
    lambda: sr.vmap(sr.nn.Linear, axis_size=4 * n + 1)(2 * w, 2 * w, rngs=sr.Rngs(0))
  )
  yield "Dense + tanh", dense, jax.ShapeDtypeStruct((32 * b * 2, 2 * w), jnp.float32), _dense_tanh


def _compiled(plan, candidate) -> int:
  """XLA's temp bytes for ``candidate`` of ``plan`` (its lengths and policy)."""
  import dataclasses

  chosen = dataclasses.replace(
    plan,
    lengths=candidate.lengths,
    policy_name=candidate.policy,
    evals=candidate.evals,
    temp_bytes=candidate.temp_bytes,
    measured_bytes=None,
  )
  return chosen.verify()


def measure(cfg: dict, only=None, *, log=print) -> tuple[list[dict], dict | None]:
  """Every block's rows (``only``: those blocks), and the pattern stack's budget case
  (None in quick mode)."""
  rows, budget_case = [], None
  for name, stack, carry, body in blocks(cfg):
    if only is not None and name not in only:
      continue
    start = time.perf_counter()
    plan = sr.plan_remat(stack, carry, fn=body)
    seconds = time.perf_counter() - start
    log(f"{name}: picked {plan.lengths} {plan.policy_name} in {seconds:.1f} s")
    for rank, candidate in enumerate(plan.candidates[: 1 + cfg["next"]]):
      measured = _compiled(plan, candidate)
      rows.append(
        {
          "block": name,
          "n": plan.n,
          "unit": plan.unit,
          "rank": rank,
          "lengths": list(candidate.lengths),
          "policy": candidate.policy,
          "evals": candidate.evals // plan.n,
          "predicted": candidate.temp_bytes,
          "measured": measured,
          "error": (candidate.temp_bytes - measured) / measured,
          "plan_seconds": seconds if rank == 0 else None,
        }
      )
    if name == "pattern" and cfg["budget"] is not None:
      start = time.perf_counter()
      planned = sr.plan_remat(stack, carry, fn=body, memory_budget=cfg["budget"])
      measured = planned.measured_bytes or planned.verify()
      budget_case = {
        "budget": cfg["budget"],
        "lengths": list(planned.lengths),
        "policy": planned.policy_name,
        "evals": planned.evals // planned.n,
        "predicted": planned.temp_bytes,
        "measured": measured,
        "fits": measured <= sr.transforms.memory._remat_plan.parse_bytes(cfg["budget"]),
        "plan_seconds": time.perf_counter() - start,
      }
  return rows, budget_case


def markdown(result: dict) -> str:
  rows, case = result["rows"], result["budget_case"]
  cfg = result["config"]
  lines = [
    "# The remat planner against XLA",
    "",
    f"`{cfg['command']}` on {cfg['machine']} ({cfg['device']}, jax {cfg['jax']}), "
    f"{cfg['date']}. Predicted: `sr.plan_remat`'s figure for the candidate; measured: "
    "XLA's temp bytes of the compiled gradient. Rank 0 is the pick.",
    "",
    "| block | N | rank | lengths | policy | evals | predicted | measured | error | plan s |",
    "|---|---:|---:|---|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    seconds = "" if r["plan_seconds"] is None else f"{r['plan_seconds']:.1f}"
    lines.append(
      f"| {r['block']} | {r['n']} {r['unit']}s | {r['rank']} | {tuple(r['lengths'])} | "
      f"{r['policy']} | {r['evals']}N | {format_bytes(r['predicted'])} | "
      f"{format_bytes(r['measured'])} | {100 * r['error']:+.1f} % | {seconds} |"
    )
  worst = max(rows, key=lambda r: abs(r["error"]))
  lines += [
    "",
    f"Largest error: {100 * worst['error']:+.1f} % ({worst['block']}, "
    f"{tuple(worst['lengths'])}, {worst['policy']}); target |error| <= {100 * TARGET:.0f} %: "
    + ("met." if abs(worst["error"]) <= TARGET else "**missed**."),
  ]
  if case is not None:
    lines += [
      "",
      f"The pattern stack under `memory_budget={case['budget']!r}`: picks "
      f"{tuple(case['lengths'])} ({case['policy']}, {case['evals']}N evaluations), "
      f"predicted {format_bytes(case['predicted'])}, measured "
      f"{format_bytes(case['measured'])}: "
      + ("fits" if case["fits"] else "**does not fit**")
      + f" (planned in {case['plan_seconds']:.1f} s).",
    ]
  return "\n".join(lines) + "\n"


def run(
  quick: bool = False,
  out: str | Path = RESULTS,
  *,
  machine: str = "",
  command: str = "python -m benchmarks --part planner",
  only=None,
  log=print,
) -> dict:
  """Measures every block (``only``: those named), writes ``planner.json`` /
  ``planner.md`` to ``out``, then raises AssertionError if a row misses the target or
  the budget's pick does not fit."""
  cfg = QUICK if quick else FULL
  rows, case = measure(cfg, only, log=log)
  result = {
    "config": {
      **cfg,
      **provenance(quick, machine, command),
    },
    "rows": rows,
    "budget_case": case,
  }
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "planner.json").write_text(json.dumps(result, indent=1))
  (out / "planner.md").write_text(markdown(result))
  missed = [r for r in rows if abs(r["error"]) > TARGET]
  assert not missed, f"the planner misses XLA by more than {TARGET:.0%} on {missed}"
  assert case is None or case["fits"], f"the budget's pick does not fit: {case}"
  return result


def main(argv=None) -> None:
  part_main("planner", __doc__, run, "small shapes, fewer candidates", argv)


if __name__ == "__main__":
  main()
