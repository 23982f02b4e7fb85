"""PNG plots of the suite's results (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .models import LIBRARIES, STRATEGIES  # noqa: E402
from .report import NAMES  # noqa: E402

STYLE = {
  "raw": ("k", "o", "-"),
  "linen": ("tab:blue", "s", "--"),
  "nnx": ("tab:orange", "^", "-."),
  "sr": ("tab:green", "x", ":"),
}


def _series(entries, lib, strategy, value):
  points = sorted(
    (e["n"], value(e))
    for e in entries
    if e["library"] == lib and e["strategy"] == strategy and e["status"] == "ok"
  )
  return [n for n, _ in points], [v for _, v in points]


def _depth_axis(ax, entries) -> None:
  """Log-scaled N, the measured depths its only ticks (log minor ticks are slow)."""
  depths = sorted({e["n"] for e in entries})
  ax.set_xscale("log")
  ax.set_xticks(depths, [str(n) for n in depths])
  ax.minorticks_off()
  ax.set_xlabel("depth N")


def _line(ax, xs, ys, lib, **kwargs):
  color, marker, style = STYLE[lib]
  ax.plot(xs, ys, color=color, marker=marker, linestyle=style, label=NAMES[lib], **kwargs)


def _save(fig, path: Path, bottom: float = 0.12) -> None:
  # Fixed margins: tight_layout costs seconds on log axes and the suite's test runs this.
  fig.subplots_adjust(left=0.06, right=0.98, bottom=bottom, top=0.9, wspace=0.25, hspace=0.35)
  fig.savefig(path, dpi=80)
  plt.close(fig)


def memory(entries: list[dict], path: Path) -> None:
  """Temp bytes against N: a panel per strategy, a line per library, log scales."""
  fig, axes = plt.subplots(
    1, len(STRATEGIES) + 1, figsize=(4 * (len(STRATEGIES) + 1), 4), sharey=True
  )
  temp = lambda e: e["bytes"]["temp"] / 2**20
  for ax, strategy in zip(axes, STRATEGIES):
    for lib in LIBRARIES:
      _line(ax, *_series(entries, lib, strategy, temp), lib)
    ax.set_title(strategy)
  last = axes[-1]
  for strategy in STRATEGIES:
    last.plot(*_series(entries, "sr", strategy, temp), marker="o", label=strategy)
  last.set_title("statefulremat, every strategy")
  for ax in axes:
    ax.set_yscale("log")
    _depth_axis(ax, entries)
    ax.grid(True, alpha=0.3)
  axes[0].legend(fontsize=8)
  last.legend(fontsize=8)
  axes[0].set_ylabel("XLA temp memory of the gradient (MiB)")
  _save(fig, path)
  plt.close(fig)


def compile_time(entries: list[dict], path: Path) -> None:
  """Compile and trace+lower seconds (median, min-max bars) against N per strategy."""
  fig, axes = plt.subplots(2, len(STRATEGIES), figsize=(4 * len(STRATEGIES), 7))
  for row, (key, label) in enumerate(
    (("compile_s", "compile s"), ("trace_lower_s", "trace+lower s"))
  ):
    for ax, strategy in zip(axes[row], STRATEGIES):
      for lib in LIBRARIES:
        xs, s = _series(entries, lib, strategy, lambda e: e[key])
        color, marker, style = STYLE[lib]
        ax.errorbar(
          xs,
          [v["median"] for v in s],
          yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]],
          color=color,
          marker=marker,
          linestyle=style,
          label=NAMES[lib],
          capsize=2,
        )
      ax.set_title(f"{strategy}: {label}")
      _depth_axis(ax, entries)
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
    axes[row][0].set_ylabel(label)
  axes[0][0].legend(fontsize=8)
  _save(fig, path)
  plt.close(fig)


def dispatch(result: dict, path: Path) -> None:
  """Median µs per step per variant, a panel per model, a bar per optimizer kind."""
  models = result["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5))
  axes = axes if len(models) > 1 else [axes]
  for ax, (model, entry) in zip(axes, models.items()):
    variants = list(entry["variants"])
    kinds = list(entry["variants"][variants[0]])
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
      xs = [i + (k - (len(kinds) - 1) / 2) * width for i in range(len(variants))]
      ax.bar(xs, [entry["variants"][v][kind]["median_us"] for v in variants], width, label=kind)
    ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs per step (median)")
    ax.set_title(f"dispatch: {model} ({entry.get('variables', '?')} variables)")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
  _save(fig, path, bottom=0.3)


def transformer(results: dict, path: Path) -> None:
  """The transformer family: temp MiB, median step s and median first call s, a group
  of bars per (N, construction), a bar per library (an absent bar: not applicable)."""
  entries = [e for e in results["entries"] if e["status"] == "ok"]
  groups = sorted({(e["n"], e["construction"]) for e in entries}, key=lambda g: (g[0], g[1]))
  libs = [lib for lib in LIBRARIES if any(e["library"] == lib for e in entries)]
  measures = (
    ("temp MiB", lambda e: e["bytes"]["temp"] / 2**20),
    ("step s (median)", lambda e: e["step_ms"]["median"] / 1000),
    ("first call s (median)", lambda e: e["first_call_s"]["median"]),
  )
  fig, axes = plt.subplots(1, len(measures), figsize=(6 * len(measures), 4.5))
  width = 0.8 / len(libs)
  for ax, (title, value) in zip(axes, measures):
    for i, lib in enumerate(libs):
      xs, ys = [], []
      for x, group in enumerate(groups):
        found = [e for e in entries if (e["n"], e["construction"]) == group and e["library"] == lib]
        if found:
          xs.append(x + (i - (len(libs) - 1) / 2) * width)
          ys.append(value(found[0]))
      ax.bar(xs, ys, width, color=STYLE[lib][0], label=NAMES[lib])
    ax.set_xticks(range(len(groups)), [f"N={n}\n{c}" for n, c in groups], fontsize=7)
    ax.set_title(title)
  axes[0].legend(fontsize=8)
  _save(fig, path, bottom=0.2)
