"""Targets and the markdown report of the suite's results.

The targets are the issue's, for statefulremat against raw JAX with the same
construction; linen and nnx are held to the same thresholds for reference.
"""

from __future__ import annotations

import math

from .models import LIBRARIES, STRATEGIES

MEMORY_RATIO = 1.01  # temp bytes over raw's, at most; outputs never more than raw's
TRACE_LOWER_RATIO = 1.1  # trace+lower seconds over raw's (median of paired sweeps)
STEP_RATIO = 1.05  # median step time over raw's, at most
FLAT_EXPONENT = 0.15  # scan forms: b in compile s ~ N^b, at most (16x deeper: <= 1.5x)
SCAN_FORMS = STRATEGIES[1:]
TARGET_LIBRARY = "sr"
NAMES = {"raw": "raw JAX", "linen": "flax.linen", "nnx": "flax.nnx", "sr": "statefulremat"}


def memory_met(entry: dict) -> bool:
  r = entry["ratio"]
  return r["temp"] <= MEMORY_RATIO and r["outputs"] <= 1.0


def growth(per_n: dict) -> float:
  """The exponent ``b`` of ``seconds ~ N^b``: a least-squares line on log-log axes.

  >>> round(growth({16: 1.0, 256: 4.0}), 3)
  0.5
  """
  xs = [math.log(n) for n in per_n]
  ys = [math.log(v) for v in per_n.values()]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def flatness(entries: list[dict]) -> list[dict]:
  """Per library and strategy: median compile seconds per N and their growth in N.

  The scan forms have the target; the unrolled loop is there for contrast.
  """
  rows = []
  for lib in LIBRARIES:
    for strategy in STRATEGIES:
      per_n = {
        e["n"]: e["compile_s"]["median"]
        for e in entries
        if e["status"] == "ok" and e["library"] == lib and e["strategy"] == strategy
      }
      if len(per_n) > 1:
        b = growth(per_n)
        rows.append(
          {
            "library": lib,
            "strategy": strategy,
            "compile_s": per_n,
            "exponent": b,
            "met": b <= FLAT_EXPONENT if strategy in SCAN_FORMS else None,
          }
        )
  return rows


def targets(results: dict) -> list[dict]:
  """Every statefulremat figure that has a target: value, target and whether it is met."""
  out = []
  mine = lambda entries: [
    e for e in entries if e["library"] == TARGET_LIBRARY and e["status"] == "ok" and "ratio" in e
  ]
  for e in mine(results["deep_stack"]):
    where = {"strategy": e["strategy"], "n": e["n"]}
    out.append(
      {
        "part": "memory",
        **where,
        "figure": "temp / raw",
        "value": e["ratio"]["temp"],
        "target": f"<= {MEMORY_RATIO}",
        "met": e["ratio"]["temp"] <= MEMORY_RATIO,
      }
    )
    out.append(
      {
        "part": "memory",
        **where,
        "figure": "outputs / raw",
        "value": e["ratio"]["outputs"],
        "target": "<= 1 (no extra outputs)",
        "met": e["ratio"]["outputs"] <= 1.0,
      }
    )
    out.append(
      {
        "part": "compile",
        **where,
        "figure": "trace+lower / raw",
        "value": e["ratio"]["trace_lower"],
        "target": f"<= {TRACE_LOWER_RATIO}",
        "met": e["ratio"]["trace_lower"] <= TRACE_LOWER_RATIO,
      }
    )
  for row in flatness(results["deep_stack"]):
    if row["library"] == TARGET_LIBRARY and row["met"] is not None:
      out.append(
        {
          "part": "compile",
          "strategy": row["strategy"],
          "n": "all",
          "figure": "b in compile s ~ N^b",
          "value": row["exponent"],
          "target": f"<= {FLAT_EXPONENT} (flat)",
          "met": row["met"],
        }
      )
  for e in mine(results.get("step", [])):
    out.append(
      {
        "part": "step",
        "strategy": e["strategy"],
        "n": e["n"],
        "figure": "median step / raw",
        "value": e["ratio"],
        "target": f"<= {STEP_RATIO}",
        "met": e["ratio"] <= STEP_RATIO,
      }
    )
  for r in results.get("remat_plan", []):
    where = {"strategy": f"plan {r['budget']}", "n": r["n"]}
    out.append(
      {
        "part": "planning",
        **where,
        "figure": "pick fits (measured <= budget)",
        "value": float(r["fits"]),
        "target": "1",
        "met": r["fits"],
      }
    )
    out.append(
      {
        "part": "planning",
        **where,
        "figure": "pick evals / exhaustive best's",
        "value": r["evals"] / (r["exhaustive_best_evals"] or float("nan")),
        "target": "1",
        "met": r["evals"] == r["exhaustive_best_evals"],
      }
    )
    out.append(
      {
        "part": "planning",
        **where,
        "figure": "|predicted / measured - 1|",
        "value": abs(r["prediction_error"]),
        "target": "<= 0.05",
        "met": abs(r["prediction_error"]) <= 0.05,
      }
    )
    out.append(
      {
        "part": "planning",
        **where,
        "figure": "planning seconds",
        "value": r["plan_seconds"],
        "target": "<= 2",
        "met": r["plan_seconds"] <= 2,
      }
    )
  for t in (results.get("dispatch") or {}).get("targets", []):
    out.append(
      {
        "part": "dispatch",
        "strategy": f"{t['model']} model, {t['optimizer']}",
        "n": "-",
        "figure": "median step / raw jax.jit",
        "value": t["ratio"],
        "target": f"<= {t['target']}",
        "met": t["met"],
      }
    )
  return out


def _size(nbytes: int) -> str:
  if nbytes >= 2**20:
    return f"{nbytes / 2**20:.2f} MiB"
  return f"{nbytes / 2**10:.2f} KiB"


def _mmm(s: dict, scale: float = 1.0, fmt: str = ".3f") -> str:
  return " / ".join(format(s[k] * scale, fmt) for k in ("min", "median", "max"))


def _yes(met: bool) -> str:
  return "met" if met else "**not met**"


def _na(e: dict, columns: int) -> str:
  cells = [str(e["n"]), e["strategy"], NAMES[e["library"]], f"n/a: {e['reason']}"]
  return "| " + " | ".join(cells + [""] * (columns - 4)) + " |"


def memory_table(entries: list[dict]) -> list[str]:
  lines = [
    "| N | strategy | library | temp | arguments | outputs | temp / raw | "
    "outputs / raw | target (temp <= 1.01x, outputs <= raw) |",
    "|---:|---|---|---:|---:|---:|---:|---:|---|",
  ]
  for e in entries:
    if e["status"] != "ok":
      lines.append(_na(e, 9))
      continue
    b, r = e["bytes"], e["ratio"]
    lines.append(
      f"| {e['n']} | {e['strategy']} | {NAMES[e['library']]} | "
      f"{_size(b['temp'])} | {_size(b['arguments'])} | "
      f"{_size(b['outputs'])} | "
      f"{r['temp']:.4f} | {r['outputs']:.4f} | {_yes(memory_met(e))} |"
    )
  return lines


def compile_table(entries: list[dict]) -> list[str]:
  lines = [
    "| N | strategy | library | trace+lower s (min / median / max) | "
    "trace+lower / raw (paired) | target (<= 1.1x) | compile s (min / median / max) | "
    "compile / raw |",
    "|---:|---|---|---:|---:|---|---:|---:|",
  ]
  for e in entries:
    if e["status"] != "ok":
      lines.append(_na(e, 8))
      continue
    r = e["ratio"]
    lines.append(
      f"| {e['n']} | {e['strategy']} | {NAMES[e['library']]} | "
      f"{_mmm(e['trace_lower_s'])} | {r['trace_lower']:.2f} | "
      f"{_yes(r['trace_lower'] <= TRACE_LOWER_RATIO)} | "
      f"{_mmm(e['compile_s'])} | {r['compile']:.2f} |"
    )
  return lines


def flatness_table(entries: list[dict]) -> list[str]:
  rows = flatness(entries)
  if not rows:
    return ["(one depth only: growth in N not measured)"]
  depths = sorted(rows[0]["compile_s"])
  lines = [
    "| strategy | library | "
    + " | ".join(f"N={n}" for n in depths)
    + f" | b in s ~ N^b | target (b <= {FLAT_EXPONENT}, flat) |",
    "|---|---|" + "---:|" * len(depths) + "---:|---|",
  ]
  for row in rows:
    cells = " | ".join(f"{row['compile_s'][n]:.3f}" for n in depths)
    met = "none (contrast)" if row["met"] is None else _yes(row["met"])
    lines.append(
      f"| {row['strategy']} | {NAMES[row['library']]} | {cells} | {row['exponent']:.2f} | {met} |"
    )
  return lines


def step_table(entries: list[dict]) -> list[str]:
  lines = [
    "| N | strategy | library | step ms (min / median / max) | median / raw | target (<= 1.05x) |",
    "|---:|---|---|---:|---:|---|",
  ]
  for e in entries:
    if e["status"] != "ok":
      lines.append(_na(e, 6))
      continue
    lines.append(
      f"| {e['n']} | {e['strategy']} | {NAMES[e['library']]} | "
      f"{_mmm(e['ms'], fmt='.2f')} | {e['ratio']:.3f} | "
      f"{_yes(e['ratio'] <= STEP_RATIO)} |"
    )
  return lines


def summary(results: dict) -> list[str]:
  rows = results["targets"]
  met = sum(t["met"] for t in rows)
  lines = [f"statefulremat meets {met} of its {len(rows)} targets.", ""]
  for part in ("memory", "compile", "step", "planning", "dispatch"):
    mine = [t for t in rows if t["part"] == part]
    if mine:
      lines.append(f"- {part}: {sum(t['met'] for t in mine)} of {len(mine)} met")
  missed = [t for t in rows if not t["met"]]
  if missed:
    lines += ["", "Not met:", ""]
    lines += [
      f"- {t['part']}, {t['strategy']}, N={t['n']}: {t['figure']} = "
      f"{t['value']:.3f} (target {t['target']})"
      for t in missed
    ]
  return lines


def markdown(results: dict, dispatch_table: str | None = None) -> str:
  c = results["config"]
  step = c["step"]
  lines = [
    "# statefulremat benchmark results",
    "",
    f"Machine: {c['machine']}; JAX {c['versions']['jax']} on {c['device']}; "
    f"flax {c['versions']['flax']}; {'quick' if c['quick'] else 'full'} mode; "
    f"{c['seconds']:.0f} s in all.",
    "",
    "The deep-stack model: N x (Linear W->W, tanh), loss mean(out**2), gradient over "
    "the params. Ratios are to raw JAX with the same construction; the targets are "
    "statefulremat's, and linen and nnx are held to them for reference. Lengths of the "
    "nested scans: "
    + ", ".join(f"N={n}: {d2} / {d3}" for n, (d2, d3) in c["lengths"].items())
    + ".",
    "",
    "## Summary",
    "",
    *summary(results),
    "",
    f"## 1. XLA compiled memory (W={c['width']}, B={c['batch']})",
    "",
    *memory_table(results["deep_stack"]),
    "",
    f"## 2. Trace+lower and compile seconds ({c['trace_reps']} lowerings and "
    f"{c['reps']} compiles of fresh functions each)",
    "",
    "Every sample is taken where CPython's frame stack has room, so no library pays "
    "for where a 16 KiB frame chunk happens to end (`benchmarks/roomy_stack.py`: "
    "CPython 3.11 and 3.12 map and free a chunk at every call across a boundary, "
    "which moved these ratios by 10-20 % with the caller's stack depth alone).",
    "",
    *compile_table(results["deep_stack"]),
    "",
    "Compile seconds against N (medians; b is the slope of a line through them on "
    "log-log axes, so 16x deeper costs 16^b times the compile time):",
    "",
    *flatness_table(results["deep_stack"]),
    "",
    f"## 3. Step time (W={step['width']}, B={step['batch']}, "
    f"N in {list(step['depths'])}, {step['calls']} interleaved calls each)",
    "",
    step["note"],
    "",
    *step_table(results["step"]),
    "",
  ]
  if dispatch_table is not None:
    lines += ["## 4. Dispatch overhead", "", dispatch_table.strip(), ""]
  if results.get("remat_plan"):
    from .remat_plan import table as plan_table

    lines += [
      "## 5. Remat planning against an exhaustive compile",
      "",
      '`sr.plan_remat`\'s pick (what `lengths="auto"` runs) for each budget; '
      "then every candidate with no more evaluations that the model puts under "
      "1.15x the budget compiled, fewest evaluations first: the exhaustive "
      "best is the first whose measured temp fits.",
      "",
      plan_table(results["remat_plan"]),
      "",
    ]
  lines += ["![memory](memory.png)", "", "![compile](compile.png)", ""]
  if dispatch_table is not None:
    lines += ["![dispatch](dispatch.png)", ""]
  return "\n".join(lines)
