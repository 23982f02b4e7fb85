"""Stacks of a repeating pattern (issue 25): ``python -m benchmarks --part pattern``.

    python -m benchmarks.pattern [--quick] [--out DIR]

A pattern of two different pre-LN blocks, (Local, Local, Global), repeated to L layers::

    Local:   x = x + fc2(gelu(fc1(ln(x))))         # MLP, hidden 2 d
    Global:  x = x + attn(ln(x), causal)            # multi-head self-attention, 4 heads

d=256, batch 8, seq 256 (2048 tokens), L in {12, 48, 192}; the loss is ``mean(y ** 2)``
and every implementation differentiates it with respect to all parameters:

* ``sr``: ``sr.remat_scan((Local, Local, Global), length=L, lengths=(L // 3,))``, one
  level (a scan over the cycles, each under ``jax.checkpoint``), and ``sr d=2``:
  ``lengths`` two nested levels of cycles ((2, 2), (4, 4), (8, 8));
* ``raw``: the hand-written raw JAX construction: the parameters of each position as
  stacked arrays, one ``lax.scan`` over the cycles whose body applies the three blocks,
  ``jax.checkpoint`` around the body (``raw d=2``: nested, checkpointed at each level,
  the same lengths);
* ``unrolled``: a raw JAX Python loop over the L layers, each under ``jax.checkpoint``,
  the parameters as L separate per-layer trees (a list of layers, written by hand).

Every implementation runs the same blocks on the same parameter values (the raw trees
are the statefulremat stack's own arrays). For every depth, in one run:

* temp memory: ``memory_analysis()`` of the compiled gradient (exact);
* first call: trace + lower + compile of a freshly made function (min / median / max
  of ``reps`` sweeps; a sweep takes every implementation of a depth in turn, in
  reversed order every other sweep);
* step time: ``calls`` synchronised calls per implementation, interleaved (one call
  each per round, the order rotating), at the step depths; min / median / max.

Targets: statefulremat's temp <= 1.01x raw JAX's with the same nesting (asserted: a
miss raises, after the results are written); first call flat in depth (``b`` in
``seconds ~ L^b`` <= 0.15, as ``benchmarks/report.py`` asks of the scan forms); step and
first call are reported as ratios to raw JAX. Writes ``pattern.json`` and ``pattern.md``
to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/pattern.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import statefulremat as sr  # noqa: E402
from benchmarks.compiling import measure as measure_compile  # noqa: E402
from benchmarks.compiling import paired_ratio, stats  # noqa: E402
from benchmarks.models import Case, lengths_for  # noqa: E402
from benchmarks.provenance import machine, provenance  # noqa: E402
from benchmarks.report import FLAT_EXPONENT, growth  # noqa: E402
from benchmarks.roomy_stack import in_roomy_stack  # noqa: E402
from benchmarks.timing import interleaved  # noqa: E402
from benchmarks.transformer_models import _attention, _b, _layer_norm, fill  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
IMPLEMENTATIONS = ("raw", "sr", "raw_d2", "sr_d2", "unrolled")
NAMES = {
  "raw": "raw JAX cycle scan",
  "sr": "statefulremat",
  "raw_d2": "raw JAX, 2 levels",
  "sr_d2": "statefulremat, 2 levels",
  "unrolled": "unrolled loop (raw JAX)",
}
BASELINE = {"sr": "raw", "sr_d2": "raw_d2", "raw": "raw", "raw_d2": "raw_d2", "unrolled": "raw"}
TEMP_RATIO = 1.01

# The unrolled loop compiles in ~70 s at L=48 here, and did not finish in 9 minutes at
# L=192: it runs at the two smaller depths. A step is ~0.7 s at L=12, ~3 s at L=48.
FULL = {
  "sizes": dict(d=256, heads=4, seq=256, batch=8),
  "depths": (12, 48, 192),
  "reps": 2,
  "unrolled_depths": (12, 48),
  "step_depths": (12, 48),
  "calls": {12: 7, 48: 5},
}
# Tiny sizes: the test suite runs this; the times are mostly dispatch and compile.
# Two depths (1 and 2 cycles) for the growth figure; compiled with most optimisations
# off, as run.py's quick mode does (the bytes are the same, the compiles faster).
QUICK = {
  "sizes": dict(d=16, heads=2, seq=8, batch=2),
  "depths": (3, 6),
  "reps": 1,
  "unrolled_depths": (3, 6),
  "step_depths": (3,),
  "calls": {3: 2},
}
UNROLLED_REASON = (
  "not measured at this depth: the unrolled loop's compile grows with "
  "L (minutes here), beyond the run's budget"
)


@dataclasses.dataclass(frozen=True)
class Config:
  """One depth: L layers of width d, h heads, inputs (batch, seq, d)."""

  n: int
  d: int = 256
  heads: int = 4
  seq: int = 256
  batch: int = 8

  @property
  def cycles(self) -> int:
    return self.n // len(PATTERN)

  @property
  def lengths(self) -> tuple[int, ...]:
    return lengths_for(self.cycles, 2)


# --- the blocks: statefulremat and raw JAX, the same computation ------------------------


def raw_local(x, p):
  """``x + fc2(gelu(fc1(ln(x))))``; ``p`` the block's parameters as a dict."""
  h = jax.nn.gelu(_layer_norm(x, p["ln"]) @ p["fc1"]["kernel"] + _b(p["fc1"]["bias"]))
  return x + h @ p["fc2"]["kernel"] + _b(p["fc2"]["bias"])


def raw_global(x, p):
  """``x + attn(ln(x))``, causal multi-head self-attention."""
  return x + _attention(_layer_norm(x, p["ln"]), p["attn"])


RAW_PATTERN = (raw_local, raw_local, raw_global)


def _values(module) -> dict:
  """A block's parameters as the nested dict the raw functions take."""
  return {
    name: _values(v) if isinstance(v, sr.Module) else v.value
    for name, v in vars(module).items()
    if isinstance(v, (sr.Module, sr.Param))
  }


class Local(sr.Module):
  """The MLP block: sr.nn layers hold its parameters, ``raw_local`` computes it."""

  def __init__(self, cfg: Config, *, rngs: sr.Rngs):
    self.ln = sr.nn.LayerNorm(cfg.d, rngs=rngs)
    self.fc1 = sr.nn.Linear(cfg.d, 2 * cfg.d, rngs=rngs)
    self.fc2 = sr.nn.Linear(2 * cfg.d, cfg.d, rngs=rngs)

  def __call__(self, x):
    return raw_local(x, _values(self))


class Global(sr.Module):
  """The attention block: sr.nn layers hold its parameters, ``raw_global`` computes it."""

  def __init__(self, cfg: Config, *, rngs: sr.Rngs):
    self.ln = sr.nn.LayerNorm(cfg.d, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(cfg.heads, cfg.d, rngs=rngs)

  def __call__(self, x):
    return raw_global(x, _values(self))


PATTERN = (Local, Local, Global)


def raw_cycle(x, params):
  """One cycle: the pattern's blocks in order, ``params`` one tree per position."""
  for block, p in zip(RAW_PATTERN, params):
    x = block(x, p)
  return x


def raw_forward(params, x, lengths):
  """``lax.scan`` over the cycles (nested ``len(lengths)`` deep), ``jax.checkpoint``
  around each level's body; ``params``: per position, leaves with the cycle axis first."""
  folded = jax.tree.map(lambda a: a.reshape(tuple(lengths) + a.shape[1:]), params)

  def level(i, h, ps):
    if i == len(lengths):
      return raw_cycle(h, ps), None
    inner = lambda h, ps: level(i + 1, h, ps)
    return jax.lax.scan(jax.checkpoint(inner, prevent_cse=False), h, ps)

  return level(0, x, folded)[0]


def unrolled_forward(layers, x):
  """The Python loop over every layer, each under ``jax.checkpoint``."""
  for i, p in enumerate(layers):
    x = jax.checkpoint(RAW_PATTERN[i % len(RAW_PATTERN)])(x, p)
  return x


def loss_of(y):
  return jnp.mean(y**2)


# --- the implementations --------------------------------------------------------------


def sr_stack(cfg: Config, lengths: tuple[int, ...]):
  """The pattern stack, built abstractly and filled on the host."""
  cls = sr.remat_scan(PATTERN, length=cfg.n, lengths=lengths)
  graphdefs = []

  def abstract():
    graphdef, state = sr.split(cls(cfg, rngs=sr.Rngs(0)))
    graphdefs.append(graphdef)
    return state

  state = jax.eval_shape(abstract)
  return sr.merge(graphdefs[0], fill(state))


def as_raw(state) -> list[dict]:
  """A pattern stack's parameters (or their gradients), as an ``sr.State``, in raw
  JAX's layout: one tree per position, cycle axis first."""
  params = [{} for _ in PATTERN]
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    # ".pattern[2].attn.query.kernel": position 2, then the names inside the block
    names = re.findall(r"\w+", jax.tree_util.keystr(path))
    tree = params[int(names[1])]
    for name in names[2:-1]:
      tree = tree.setdefault(name, {})
    tree[names[-1]] = leaf
  return params


def unstacked(params: list[dict], n: int) -> list[dict]:
  """Per-layer trees: layer ``i`` is cycle ``i // P`` of position ``i % P``."""
  period = len(params)
  return [jax.tree.map(lambda a: a[i // period], params[i % period]) for i in range(n)]


def inputs(cfg: Config):
  return jax.random.normal(jax.random.key(1), (cfg.batch, cfg.seq, cfg.d), jnp.float32)


def build(cfg: Config) -> dict[str, Case]:
  """``{implementation: Case}``: a fresh jitted gradient maker and its arguments."""
  x = inputs(cfg)
  one, two = (cfg.cycles,), cfg.lengths
  stacks = {"sr": sr_stack(cfg, one), "sr_d2": sr_stack(cfg, two)}
  params = as_raw(sr.state(stacks["sr"], sr.Param))

  def sr_case(stack):
    def new():
      return sr.jit(lambda model, x: sr.grad(lambda m, x: loss_of(m(x)))(model, x))

    return Case(new, (stack, x))

  def raw_case(lengths):
    def new():
      return jax.jit(jax.grad(lambda p, x: loss_of(raw_forward(p, x, lengths))))

    return Case(new, (params, x))

  def unrolled_case():
    def new():
      return jax.jit(jax.grad(lambda ls, x: loss_of(unrolled_forward(ls, x))))

    return Case(new, (unstacked(params, cfg.n), x))

  return {
    "raw": raw_case(one),
    "sr": sr_case(stacks["sr"]),
    "raw_d2": raw_case(two),
    "sr_d2": sr_case(stacks["sr_d2"]),
    "unrolled": unrolled_case(),
  }


# --- measuring --------------------------------------------------------------------------


def measure(
  cfg: Config, reps: int, calls: int | None, unrolled: bool = True, log=print
) -> list[dict]:
  """One entry per implementation at this depth; ``calls`` None: no step time;
  ``unrolled`` False: the unrolled loop is listed as not measured."""
  cases = build(cfg)
  entries = {
    name: {
      "implementation": name,
      "n": cfg.n,
      "cycles": cfg.cycles,
      "lengths": [cfg.cycles]
      if name in ("raw", "sr")
      else list(cfg.lengths)
      if name in ("raw_d2", "sr_d2")
      else None,
      "status": "ok",
    }
    for name in IMPLEMENTATIONS
  }
  if not unrolled:
    del cases["unrolled"]
    entries["unrolled"].update(status="not measured", reason=UNROLLED_REASON)
  first = {name: ([], [], []) for name in cases}
  fns = {}
  for rep in range(reps):
    order = list(cases) if rep % 2 == 0 else list(reversed(cases))
    for name in order:
      fn = cases[name].new()  # fresh closures and wrappers: no cache to hit
      lower_s, compile_s, nbytes = in_roomy_stack(lambda: measure_compile(fn, cases[name].args))
      for samples, value in zip(first[name], (lower_s + compile_s, lower_s, compile_s)):
        samples.append(value)
      previous = entries[name].setdefault("bytes", nbytes)
      if previous != nbytes:
        raise AssertionError(
          f"{name} L={cfg.n}: bytes changed between repetitions: {previous} then {nbytes}"
        )
      fns[name] = (fn, cases[name].args)
    log(f"  L={cfg.n}: first-call sweep {rep + 1} of {reps} done ({time.strftime('%H:%M:%S')})")
  for name, (seconds, lower_s, compile_s) in first.items():
    entries[name].update(
      first_call_s=stats(seconds), trace_lower_s=stats(lower_s), compile_s=stats(compile_s)
    )
  if calls:
    for fn, args in fns.values():  # one untimed step each (the compile is cached)
      jax.block_until_ready(fn(*args))
    steps, _ = interleaved(fns, calls)
    for name, ms in steps.items():
      entries[name]["step_ms"] = stats(ms)
  for name in cases:
    e, base = entries[name], entries[BASELINE[name]]
    e["ratio"] = {
      "temp": e["bytes"]["temp"] / base["bytes"]["temp"],
      "first_call": paired_ratio(e["first_call_s"]["samples"], base["first_call_s"]["samples"]),
      **(
        {"step": paired_ratio(e["step_ms"]["samples"], base["step_ms"]["samples"])} if calls else {}
      ),
    }
  log(
    f"  L={cfg.n}: "
    + " | ".join(
      f"{name} {e['bytes']['temp'] / 2**20:.1f} MiB {e['first_call_s']['median']:.2f} s"
      + (f" {e['step_ms']['median']:.0f} ms" if calls else "")
      for name, e in entries.items()
      if name in cases
    )
  )
  return list(entries.values())


def targets(entries: list[dict]) -> list[dict]:
  """statefulremat's figures against their targets."""
  out = []
  for e in entries:
    if e["implementation"] in ("sr", "sr_d2") and e["status"] == "ok":
      out.append(
        {
          "implementation": e["implementation"],
          "n": e["n"],
          "figure": f"temp / {NAMES[BASELINE[e['implementation']]]}",
          "value": e["ratio"]["temp"],
          "target": f"<= {TEMP_RATIO}",
          "met": e["ratio"]["temp"] <= TEMP_RATIO,
        }
      )
  for row in flatness(entries):
    if row["implementation"] in ("sr", "sr_d2"):
      out.append(
        {
          "implementation": row["implementation"],
          "n": "all",
          "figure": "b in first call s ~ L^b",
          "value": row["exponent"],
          "target": f"<= {FLAT_EXPONENT} (flat)",
          "met": row["exponent"] <= FLAT_EXPONENT,
        }
      )
  return out


def flatness(entries: list[dict]) -> list[dict]:
  """Per implementation: median first-call seconds per L and their growth in L."""
  rows = []
  for name in IMPLEMENTATIONS:
    per_n = {
      e["n"]: e["first_call_s"]["median"]
      for e in entries
      if e["implementation"] == name and e["status"] == "ok"
    }
    if len(per_n) > 1:
      rows.append({"implementation": name, "first_call_s": per_n, "exponent": growth(per_n)})
  return rows


def run(
  quick: bool = False,
  out: str | Path = RESULTS,
  *,
  machine: str = "",
  command: str = "python -m benchmarks --part pattern",
  log=print,
) -> dict:
  """Measures every depth, writes ``pattern.json`` / ``pattern.md`` to ``out``, then
  raises AssertionError if statefulremat's temp memory misses its target."""
  from benchmarks.run import _fast_compiles

  config = QUICK if quick else FULL
  start = time.perf_counter()
  entries = []
  for n in config["depths"]:
    cfg = Config(n, **config["sizes"])
    log(f"L={n}: {cfg.cycles} cycles, 2 levels {cfg.lengths} ({time.strftime('%H:%M:%S')})")
    calls = config["calls"][n] if n in config["step_depths"] else None
    with _fast_compiles(quick):
      entries += measure(cfg, config["reps"], calls, n in config["unrolled_depths"], log=log)
  result = {
    "config": {
      **{k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if k != "calls"},
      "calls": {str(k): v for k, v in config["calls"].items()},
      **provenance(quick, machine, command),
      "seconds": time.perf_counter() - start,
    },
    "entries": entries,
    "flatness": flatness(entries),
    "targets": targets(entries),
  }
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "pattern.json", "w") as f:
    json.dump(result, f, indent=1)
  (out / "pattern.md").write_text(markdown(result))
  missed = [t for t in result["targets"] if t["figure"].startswith("temp") and not t["met"]]
  if missed:
    raise AssertionError(
      "statefulremat's temp memory exceeds 1.01x the raw JAX cycle scan: "
      + "; ".join(f"{t['implementation']} L={t['n']}: {t['value']:.4f}x" for t in missed)
    )
  return result


# --- the report -------------------------------------------------------------------------


def _mmm(s: dict, scale: float = 1.0, fmt: str = ".2f") -> str:
  return " / ".join(format(s[k] * scale, fmt) for k in ("min", "median", "max"))


def markdown(result: dict) -> str:
  c = result["config"]
  sizes = c["sizes"]
  met = sum(t["met"] for t in result["targets"])
  lines = [
    "# Stacks of a repeating pattern (issue 25)",
    "",
    f"Measured {c['date']} on {c['machine'] or c['device']} (`{c['command']}`, "
    f"JAX {c['jax']}, {c['seconds']:.0f} s), every figure in one process.",
    "",
    f"Pattern (Local, Local, Global): Local = pre-LN MLP (hidden 2d), Global = pre-LN "
    f"causal self-attention ({sizes['heads']} heads); d={sizes['d']}, batch "
    f"{sizes['batch']}, seq {sizes['seq']}; gradient of mean(y^2) over all parameters. "
    "Ratios to the hand-written raw JAX cycle scan with the same nesting (the unrolled "
    "loop: to the one-level scan). Temp is XLA's `memory_analysis()` (exact); first "
    f"call = trace + lower + compile of a fresh function, {c['reps']} sweeps, ratio = "
    "median of the paired ratios; step = synchronised calls, interleaved, ratio = "
    "median of the paired ratios.",
    "",
    f"Targets: {met} of {len(result['targets'])} met.",
    "",
    "| L | implementation | lengths (cycles) | temp MiB | temp / raw | first call s "
    "(min / median / max) | first call / raw | step ms (min / median / max) | "
    "step / raw |",
    "|---:|---|---|---:|---:|---|---:|---|---:|",
  ]
  for e in result["entries"]:
    if e["status"] != "ok":
      lines.append(f"| {e['n']} | {NAMES[e['implementation']]} | unrolled | {e['reason']} |||||| ")
      continue
    step = (
      f"{_mmm(e['step_ms'], fmt='.0f')} | {e['ratio']['step']:.3f}"
      if "step_ms" in e
      else "not timed | "
    )
    lengths = "unrolled" if e["lengths"] is None else str(tuple(e["lengths"]))
    lines.append(
      f"| {e['n']} | {NAMES[e['implementation']]} | {lengths} | "
      f"{e['bytes']['temp'] / 2**20:.2f} | {e['ratio']['temp']:.4f} | "
      f"{_mmm(e['first_call_s'])} | {e['ratio']['first_call']:.3f} | {step} |"
    )
  depths = sorted({e["n"] for e in result["entries"]})
  lines += [
    "",
    "First call against depth (median s; b in s ~ L^b, "
    f"target b <= {FLAT_EXPONENT} for the scans):",
    "",
    "| implementation | " + " | ".join(f"L={n}" for n in depths) + " | b |",
    "|---|" + "---:|" * (len(depths) + 1),
  ]
  for row in result["flatness"]:
    lines.append(
      f"| {NAMES[row['implementation']]} | "
      + " | ".join(
        f"{row['first_call_s'][n]:.2f}" if n in row["first_call_s"] else "-" for n in depths
      )
      + f" | {row['exponent']:.2f} |"
    )
  lines += ["", "| target | value | met |", "|---|---:|---|"]
  for t in result["targets"]:
    lines.append(
      f"| {NAMES[t['implementation']]}, L={t['n']}: {t['figure']} "
      f"{t['target']} | {t['value']:.4f} | {'yes' if t['met'] else 'no'} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
  parser.add_argument("--out", default=RESULTS, help=f"output folder (default {RESULTS})")
  args = parser.parse_args(argv)
  result = run(
    args.quick,
    args.out,
    machine=machine(),
    command="python -m benchmarks.pattern" + (" --quick" * args.quick),
  )
  print(markdown(result))


if __name__ == "__main__":
  main()
