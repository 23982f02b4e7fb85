"""``policy="auto"`` against MaxText's estimator, the best preset and exhaustive search.

    python -m benchmarks.auto_policy [--quick] [--out DIR]

Blocks (float32, 24 layers, on this machine's default device): ``GPT`` (pre-LN causal
self-attention and a 4x MLP), ``GQA`` (the same, 2 key/value heads), ``pattern``
(Gemma-like cycles of five local and one global attention block, 4 cycles) and ``conv``
(Conv 3x3, GroupNorm, ReLU, Conv 3x3, residual). Every assignment of a block's
checkpoint names to remat or device is a policy (``sr.policies.custom``; this CPU moves
nothing to host memory, so nothing is offloaded). A table holds, per (policy, nesting),
XLA's temp bytes for the stack's gradient (compiled) and the FLOPs the step recomputes
beyond one forward pass, ``(levels - 1) * N * forward + N * recomputed(policy)``, counted
from the block's jaxpr. At eight budgets, spaced geometrically (the trade-off lives near
the least) from the least any plan needs to what the stack needs with no remat at all:

* (a) ``sr.plan_remat(stack, carry, policy="auto", memory_budget=budget)``;
* (b) MaxText's estimator, written from its description (``maxtext/utils/estimator.py``):
  the chain "every name recomputed, then one name more kept on the device at a time,
  smallest first" walked down from the end keeping every name until one fits; at
  ``scan(remat)`` (one level, MaxText's) and at the best nesting for each policy;
* (c) the best of ``sr.policies``' device presets (read on the block's names) at its best
  nesting;
* (d) exhaustive: the fewest recomputed FLOPs over every (policy, nesting) that fits (the
  blocks whose table is complete: every policy at every nesting).

Per row: fits?, measured temp, recomputed FLOPs, evaluations. Targets, asserted after the
files are written: (a) fits at every budget, recomputes no more than (b) and (c), and is
within 5 % of (d). Also ``plan.frontier`` per block (monotone) and the planning seconds
and compiles of a 24-layer GPT stack. Writes ``auto_policy.json`` / ``.md`` and
``auto_frontier.png`` (matplotlib, where installed) to ``--out`` (``benchmarks/results``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/auto_policy.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import statefulremat as sr  # noqa: E402
from benchmarks.planner import GPT, ConvBlock, GemmaBlock, _abstract  # noqa: E402
from benchmarks.provenance import part_main, provenance  # noqa: E402
from statefulremat.core import _caches  # noqa: E402
from statefulremat.transforms.memory import _remat_names, _remat_plan, _remat_search  # noqa: E402
from statefulremat.transforms.memory._carries import quiet  # noqa: E402
from statefulremat.transforms.memory._remat_plan import format_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL = {"batch": 4, "seq": 64, "width": 128, "layers": 24, "budgets": 8, "exhaustive": 5}
QUICK = {"batch": 2, "seq": 16, "width": 32, "layers": 6, "budgets": 3, "exhaustive": 2}
NEAR = 0.05  # (a)'s recomputed FLOPs within this of the exhaustive optimum
DEVICE_PRESETS = (
  "full",
  "minimal",
  "minimal_with_context",
  "save_dot_with_context_except_mlp",
  "save_dot_except_mlpwi",
  "save_dot_except_mlp",
  "save_qkv_proj",
  "save_out_proj",
)


def apply(layer, x):
  return layer(x)


def blocks(cfg: dict):
  """``(name, abstract stack, carry, exhaustive?)`` per block."""
  b, s, w, n = cfg["batch"], cfg["seq"], cfg["width"], cfg["layers"]
  tokens = jax.ShapeDtypeStruct((b, s, w), jnp.float32)
  heads = max(2, w // 32)
  yield "GPT", _abstract(GPT, n, w, heads), tokens, True
  yield "GQA", _abstract(GPT, n, w, heads, kv_heads=2), tokens, False
  window = max(4, s // 4)
  local = functools.partial(GemmaBlock, w, window=window, rope_base=10_000.0)
  world = functools.partial(GemmaBlock, w, window=None, rope_base=1_000_000.0)
  pattern = _abstract((local,) * 5 + (world,), max(n, 12))  # two cycles at least
  yield "pattern", pattern, tokens, False
  image = jax.ShapeDtypeStruct((b, s // 4, s // 4, w // 4), jnp.float32)
  yield "conv", _abstract(ConvBlock, n, w // 4), image, True


class Table:
  """Per (policy, nesting) of one stack: XLA's temp bytes (compiled once) and FLOPs."""

  def __init__(self, stack, carry):
    self.stack, self.carry = stack, carry
    self.n, unit_fn, states, _ = _remat_plan.unit_inputs(stack, apply)
    self.names = _remat_names.name_table(unit_fn, states, carry)
    self.forward = self.names.forward_flops
    exact = functools.partial(_remat_names.recomputed_flops, unit_fn, states, carry)
    self.recomputed = functools.cache(lambda policy: exact(policy)[1])
    self.bytes: dict = {}
    self.compiles = 0

  def policy(self, kept) -> sr.policies.Policy:
    choices = {name: "device" if name in kept else "remat" for name in self.names.names}
    return _remat_names.custom_policy(choices)

  def flops(self, lengths, policy) -> int:
    return (len(lengths) - 1) * self.n * self.forward + self.n * self.recomputed(policy)

  def temp(self, lengths, policy) -> int:
    key = (lengths, policy)
    if key not in self.bytes:
      plan = _remat_plan.RematPlan(self.n, lengths, "p", 0, 0, None, (), 0, 0, None)
      plan = dataclasses.replace(plan, _policies={"p": policy})
      run = _remat_search._candidate(apply, plan)
      loss = lambda m, c: jnp.sum(run(m, c))
      with quiet():  # the planner's own compiles are as quiet
        lowered = sr.jit(sr.grad(loss)).lower(self.stack, self.carry)
      compiled = lowered.compile(_remat_search._planning_options())
      self.bytes[key] = int(compiled.memory_analysis().temp_size_in_bytes)
      self.compiles += 1
    return self.bytes[key]

  def best(self, policies, nestings, budget):
    """The fewest-FLOPs (policy, lengths) that fits ``budget``, or None."""
    fitting = [
      (self.flops(lengths, p), lengths, p)
      for p in policies
      for lengths in nestings
      if self.temp(lengths, p) <= budget
    ]
    return min(fitting, key=lambda f: (f[0], self.temp(f[1], f[2])), default=None)


def no_remat_bytes(stack, carry) -> int:
  scanned = sr.scan(lambda layer, c: (layer(c), None), variable_axes={True: 0})
  loss = lambda m, c: jnp.sum(scanned(m, c)[0])
  return int(
    sr.jit(sr.grad(loss)).lower(stack, carry).compile().memory_analysis().temp_size_in_bytes
  )


def row(method, table, pick, budget) -> dict:
  if pick is None:
    return {"method": method, "fits": False, "temp": None, "flops": None, "evals": None}
  flops, lengths, policy = pick
  return {
    "method": method,
    "fits": table.temp(lengths, policy) <= budget,
    "temp": table.temp(lengths, policy),
    "flops": flops,
    "evals": (len(lengths) + 1),
    "lengths": list(lengths),
    "policy": repr(policy),
  }


def measure_block(name, stack, carry, exhaustive, cfg, log) -> dict:
  table = Table(stack, carry)
  names = [m for m in table.names.names if table.names.bytes[m] or table.names.flops[m]]
  nestings = sorted(_remat_plan.nestings(table.n, 2), key=lambda n: (len(n), -n[0]))
  nestings = nestings[: cfg["exhaustive"]]
  by_size = sorted(names, key=lambda m: table.names.bytes[m])
  chain = [table.policy(by_size[:i]) for i in range(len(by_size) + 1)]
  presets = {
    p: table.policy([m for m in names if m in sr.policies.preset(p).saved]) for p in DEVICE_PRESETS
  }
  every = [table.policy(k) for r in range(len(names) + 1) for k in itertools.combinations(names, r)]
  t = time.perf_counter()
  plan = sr.plan_remat(stack, carry, policy="auto")
  plan_seconds = time.perf_counter() - t
  log(f"{name}: N={table.n}, names {names}; frontier planned in {plan_seconds:.1f} s")
  frontier = [
    {"lengths": list(p.lengths), "temp": p.measured_bytes, "flops": table.flops(p.lengths, p.policy),
     "cost": p.cost, "policy": repr(p.policy)}
    for p in plan.frontier
  ]  # fmt: skip
  candidates = every if exhaustive else list({*chain, *presets.values()})
  least = min(
    min(table.temp(lengths, p) for lengths in nestings for p in candidates),
    plan.frontier[0].measured_bytes,
  )
  most = no_remat_bytes(stack, carry)
  rows = []
  for budget in np.geomspace(least, most, cfg["budgets"]).astype(int).tolist():
    t = time.perf_counter()
    try:
      auto = sr.plan_remat(stack, carry, policy="auto", memory_budget=budget)
      picked = (table.flops(auto.lengths, auto.policy), auto.lengths, auto.policy)
    except sr.TransformError:
      picked = None
    seconds = time.perf_counter() - t
    scan_remat = next(
      ((table.flops((table.n,), p), (table.n,), p) for p in reversed(chain)
       if table.temp((table.n,), p) <= budget), None,
    )  # fmt: skip
    greedy = next(
      (b for b in (table.best([p], nestings, budget) for p in reversed(chain)) if b), None
    )
    preset = table.best(list(presets.values()), nestings, budget)
    rows.append(
      {
        "block": name,
        "budget": budget,
        "auto": {**row("auto", table, picked, budget), "plan_seconds": seconds},
        "greedy_scan_remat": row("MaxText greedy, scan(remat)", table, scan_remat, budget),
        "greedy_best_nesting": row("MaxText greedy, best nesting", table, greedy, budget),
        "best_preset": row("best preset", table, preset, budget),
        "exhaustive": row("exhaustive", table, table.best(every, nestings, budget), budget)
        if exhaustive
        else None,
      }
    )
    log(f"  budget {budget}: auto {rows[-1]['auto']['flops']} vs preset "
        f"{rows[-1]['best_preset']['flops']} greedy {rows[-1]['greedy_best_nesting']['flops']}")  # fmt: skip
  return {
    "block": name,
    "n": table.n,
    "names": names,
    "nestings": [list(n) for n in nestings],
    "no_remat": most,
    "frontier": frontier,
    "frontier_seconds": plan_seconds,
    "compiles": table.compiles,
    "rows": rows,
  }


def planning_cost(cfg) -> dict:
  """Seconds and compiles of ``sr.plan_remat(policy="auto")`` on a 24-layer GPT stack."""
  w = cfg["width"]
  stack = _abstract(GPT, 24, w, max(2, w // 32))
  carry = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"], w), jnp.float32)
  sr.plan_remat(stack, carry)  # the process's one-time probes
  # As a new process plans it: the blocks above measured this stack (the same body and
  # shapes), and the planner keeps what it measured.
  _caches.planned_bytes.clear()
  compiles = []
  original = jax.stages.Lowered.compile
  jax.stages.Lowered.compile = lambda self, *a, **k: compiles.append(1) or original(self, *a, **k)
  try:
    t = time.perf_counter()
    _ = sr.plan_remat(stack, carry, policy="auto").frontier  # read: compiled too
    return {"seconds": time.perf_counter() - t, "compiles": len(compiles)}
  finally:
    jax.stages.Lowered.compile = original


def verdicts(result) -> list[str]:
  """What misses a target (empty: none)."""
  missed = []
  for block in result["blocks"]:
    temps = [p["temp"] for p in block["frontier"]]
    flops = [p["flops"] for p in block["frontier"]]
    if temps != sorted(temps) or flops != sorted(flops, reverse=True):
      missed.append(f"{block['block']}: the frontier is not monotone")
    for r in block["rows"]:
      a = r["auto"]
      where = f"{block['block']} at {r['budget']} B"
      if not a["fits"]:
        missed.append(f"{where}: auto does not fit")
        continue
      for other in ("greedy_scan_remat", "greedy_best_nesting", "best_preset"):
        if r[other]["fits"] and a["flops"] > r[other]["flops"]:
          missed.append(f"{where}: auto recomputes more than {r[other]['method']}")
      best = r["exhaustive"]
      if best and best["fits"] and a["flops"] > (1 + NEAR) * best["flops"]:
        missed.append(f"{where}: auto is {a['flops'] / best['flops'] - 1:.1%} over the optimum")
  return missed


def _mib(n):
  return "—" if n is None else format_bytes(n)


def _gflop(n):
  return "—" if n is None else f"{n / 1e9:.3f}"


def markdown(result) -> str:
  cfg = result["config"]
  cost = result["planning"]
  lines = [
    "# Choosing what to keep by name (policy auto) against the MaxText estimator, the best "
    "preset and exhaustive search",
    "",
    f"`{cfg['command']}` on {cfg['machine'] or cfg['device']}, jax {cfg['jax']}, {cfg['date']}. "
    f"Batch {cfg['batch']}, sequence {cfg['seq']}, width {cfg['width']}, {cfg['layers']} "
    "layers, float32. Temp: XLA's compiled temp bytes of the stack's gradient; FLOPs: "
    "recomputed per step beyond one forward pass (GFLOP); evals: block evaluations per "
    "layer. `—`: nothing fits.",
    "",
    f'Planning a 24-layer GPT stack with `policy="auto"` (no budget, the frontier '
    f"included): {cost['seconds']:.1f} s, {cost['compiles']} compiles.",
  ]
  methods = ("auto", "greedy_scan_remat", "greedy_best_nesting", "best_preset", "exhaustive")
  for block in result["blocks"]:
    lines += [
      "",
      f"## {block['block']} (N = {block['n']}, names: {', '.join(block['names'])})",
      "",
      f"No remat needs {_mib(block['no_remat'])}. Nestings in the table: "
      f"{', '.join(str(tuple(n)) for n in block['nestings'])}; {block['compiles']} compiles.",
      "",
      "| budget | " + " | ".join(
        f"{m}: fits / temp / GFLOP / evals" for m in methods if block["rows"][0].get(m)
      ) + " |",
      "|" + "---|" * (1 + sum(1 for m in methods if block["rows"][0].get(m))),
    ]  # fmt: skip
    for r in block["rows"]:
      cells = [
        f"{'yes' if r[m]['fits'] else 'no'} / {_mib(r[m]['temp'])} / {_gflop(r[m]['flops'])}"
        f" / {r[m]['evals'] or '—'}"
        for m in methods
        if r.get(m)
      ]
      lines.append(f"| {_mib(r['budget'])} | " + " | ".join(cells) + " |")
    lines += ["", "Frontier (`plan.frontier`): " + "; ".join(
      f"{_mib(p['temp'])} at {_gflop(p['flops'])} GFLOP {tuple(p['lengths'])}"
      for p in block["frontier"]
    ) + "."]  # fmt: skip
  missed = verdicts(result)
  lines += ["", "Targets: " + ("all met." if not missed else "missed: " + "; ".join(missed))]
  return "\n".join(lines) + "\n"


def plot(result, path: Path) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  for block in result["blocks"]:
    xs = [p["temp"] / 2**20 for p in block["frontier"]]
    ys = [p["flops"] / 1e9 for p in block["frontier"]]
    ax.plot(xs, ys, marker="o", label=block["block"])
  ax.set_xlabel("compiled temp memory (MiB)")
  ax.set_ylabel("recomputed GFLOP per step")
  ax.set_title('plan.frontier with policy="auto"')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def run(quick=False, out=RESULTS, *, machine="", command="python -m benchmarks.auto_policy",
        only=None, log=print) -> dict:  # fmt: skip
  cfg = QUICK if quick else FULL
  result = {
    "config": {
      **cfg,
      **provenance(quick, machine, command),
    },
    "blocks": [
      measure_block(name, stack, carry, exhaustive, cfg, log)
      for name, stack, carry, exhaustive in blocks(cfg)
      if only is None or name in only
    ],
    "planning": planning_cost(cfg),
  }
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "auto_policy.json").write_text(json.dumps(result, indent=1))
  (out / "auto_policy.md").write_text(markdown(result))
  plot(result, out / "auto_frontier.png")
  missed = verdicts(result)
  assert not missed, "policy='auto' misses its targets: " + "; ".join(missed)
  return result


def main(argv=None) -> None:
  part_main("auto_policy", __doc__, run, "small shapes, 6 layers, 3 budgets", argv)


if __name__ == "__main__":
  main()
