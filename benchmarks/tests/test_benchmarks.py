"""The benchmark suite's quick mode runs end to end: every variant ran, files written.

No timing assertions: the suite measures, it never fails on a slow figure.
"""

import json
import sys

import pytest

from benchmarks import report
from benchmarks import run as suite
from benchmarks import transformer_models as tm
from benchmarks.dispatch_variants import KINDS, VARIANTS
from benchmarks.frame_chunks import ALIGNMENTS, CHUNK, ChunkedStack, simulate
from benchmarks.models import LIBRARIES, STRATEGIES
from benchmarks.roomy_stack import in_roomy_stack


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("results")
  suite.run(quick=True, out=out, log=lambda *a: None)
  return out, json.loads((out / "results.json").read_text())


def _by_key(entries):
  return {(e["library"], e["strategy"], e["n"]): e for e in entries}


def test_every_variant_compiled_with_positive_bytes(quick):
  _, results = quick
  entries = _by_key(results["deep_stack"])
  for lib in LIBRARIES:
    for strategy in STRATEGIES:
      for n in suite.QUICK["depths"]:
        e = entries[(lib, strategy, n)]
        if e["status"] == "n/a":
          assert e["reason"]
          continue
        assert e["status"] == "ok"
        assert all(e["bytes"][k] > 0 for k in ("temp", "arguments", "outputs"))
        assert e["trace_lower_s"]["median"] > 0 and e["compile_s"]["median"] > 0
        assert set(e["ratio"]) >= {"temp", "outputs", "trace_lower", "compile"}


def test_every_variant_was_timed(quick):
  _, results = quick
  entries = _by_key(results["step"])
  for lib in LIBRARIES:
    for strategy in STRATEGIES:
      for n in suite.QUICK["step"]["depths"]:
        e = entries[(lib, strategy, n)]
        assert e["status"] == "ok" or e["reason"]
        if e["status"] == "ok":
          assert len(e["ms"]["samples"]) == suite.QUICK["step"]["calls"]
          assert e["ratio"] > 0


def test_same_arguments_as_raw(quick):
  # Every library differentiates the same parameters: equal argument bytes.
  _, results = quick
  for e in results["deep_stack"]:
    if e["status"] == "ok":
      assert e["ratio"]["arguments"] == 1.0, e


def test_targets_and_files(quick):
  out, results = quick
  assert results["targets"]
  assert all(isinstance(t["met"], bool) for t in results["targets"])
  assert {t["part"] for t in results["targets"]} == {
    "memory",
    "compile",
    "step",
    "planning",
    "dispatch",
  }
  text = (out / "results.md").read_text()
  assert "## 1. XLA compiled memory" in text and "## 4. Dispatch overhead" in text
  assert "## 5. Remat planning" in text
  for name in ("memory.png", "compile.png", "dispatch.png"):
    assert (out / name).stat().st_size > 0


def test_every_planned_pick_fits_and_was_checked_by_compiling(quick):
  _, results = quick
  rows = results["remat_plan"]
  assert len(rows) == 3  # one depth, three budgets
  for r in rows:
    assert r["fits"] and r["compiled"] >= 1 and r["measured"] > 0
    assert r["evals"] >= r["exhaustive_best_evals"] > 0


def test_every_dispatch_variant_was_timed(quick):
  _, results = quick
  dispatch = results["dispatch"]
  for model in ("tiny", "wide"):
    entry = dispatch["models"][model]
    assert entry["variables"] > 0
    # An optional library that is not installed (SpectraX) is listed as skipped.
    assert set(entry["variants"]) | set(dispatch["skipped"]) == set(VARIANTS)
    assert not set(entry["variants"]) & set(dispatch["skipped"])
    for kinds in entry["variants"].values():
      assert set(kinds) == set(KINDS)
      for s in kinds.values():
        assert 0 < s["min_us"] <= s["median_us"] <= s["max_us"]
        assert s["ratio"] > 0 and s["paired_ratio"] > 0 and s["calls"] >= 1
  assert {(t["model"], t["optimizer"]) for t in dispatch["targets"]} == {
    (m, k) for m in ("tiny", "wide") for k in KINDS
  }


def test_every_transformer_variant_ran_with_positive_bytes(quick):
  out, results = quick
  family = json.loads((out / "transformer.json").read_text())
  entries = {(e["library"], e["construction"], e["n"]): e for e in family["entries"]}
  for lib in tm.LIBRARIES:
    for construction in tm.CONSTRUCTIONS:
      for n in suite.transformer.QUICK["depths"]:
        e = entries[(lib, construction, n)]
        if e["status"] == "n/a":  # linen and nnx have no lengths="auto"
          assert lib in ("linen", "nnx") and construction == "remat_scan_auto"
          assert e["reason"]
          continue
        assert all(e["bytes"][k] > 0 for k in ("temp", "arguments", "outputs")), e
        assert e["first_call_s"]["median"] > 0 and e["step_ms"]["median"] > 0
        assert e["dispatch_us"]["median"] > 0
        assert set(e["ratio"]) == {"temp", "step", "first_call", "dispatch"}
  assert results["transformer_targets"] == family["targets"]
  assert len(family["targets"]) == 3 * len(tm.CONSTRUCTIONS)
  assert "| statefulremat |" in (out / "transformer.md").read_text()
  assert (out / "transformer.png").stat().st_size > 0


def test_transformer_sr_loss_equals_raw_with_the_same_params():
  # Dropout off: the stacked sr model and the hand-written raw stack, given sr's
  # parameters (renamed into raw's layout), compute the same blocks and loss.
  import jax
  import jax.numpy as jnp
  import numpy as np

  cfg = tm.Config(n=3, d=8, heads=2, seq=5, batch=2, dropout=0.0)
  model = tm.sr_stack("scan_remat", cfg, kernel_std=0.5)
  params = tm.sr_params_as_raw(model)
  assert jax.tree.structure(params) == jax.tree.structure(tm.raw_abstract(cfg))
  x = tm.inputs(cfg)
  ours = model(x)[0] - x
  for construction, lengths in (("scan_remat", None), ("remat_scan", (3, 1))):
    raw = tm.raw_forward(construction, params, x, None, 0.0, lengths) - x
    assert float(jnp.abs(raw).mean()) > 1e-2  # the blocks do change x
    np.testing.assert_allclose(ours, raw, rtol=1e-4, atol=1e-5)


def test_lengths_are_the_issues():
  from benchmarks.models import lengths_for

  assert [lengths_for(n, 2) for n in (16, 64, 100, 256)] == [(4, 4), (8, 8), (10, 10), (16, 16)]
  assert [lengths_for(n, 3) for n in (16, 64, 100, 256)] == [
    (2, 2, 4),
    (4, 4, 4),
    (4, 5, 5),
    (4, 8, 8),
  ]


def test_compile_growth_exponent():
  # Flat for scan forms, about linear for the unrolled loop (the quick run has one N).
  entries = [
    {
      "library": "sr",
      "strategy": strategy,
      "n": n,
      "status": "ok",
      "compile_s": {"median": seconds},
    }
    for strategy, per_n in (("scan", {16: 1.0, 256: 1.1}), ("unrolled", {16: 1.0, 256: 16.0}))
    for n, seconds in per_n.items()
  ]
  rows = {row["strategy"]: row for row in report.flatness(entries)}
  assert rows["scan"]["met"] and rows["scan"]["exponent"] < 0.05
  assert rows["unrolled"]["met"] is None and abs(rows["unrolled"]["exponent"] - 1) < 1e-9


def test_measurements_run_under_a_512_kib_frame_and_errors_pass_through():
  callers = []
  assert in_roomy_stack(lambda: callers.append(sys._getframe(1)) or 7) == 7
  assert callers[0].f_code.co_nlocals >= 1 << 16  # 8 bytes a slot: CPython's own chunk
  with pytest.raises(ZeroDivisionError):
    in_roomy_stack(lambda: 1 / 0)


def test_the_chunk_simulation_maps_a_chunk_at_every_call_across_a_boundary():
  near_the_end = ChunkedStack(CHUNK - 100)
  for _ in range(3):
    near_the_end.push(200)
    near_the_end.pop()
  assert near_the_end.mapped == 3 and near_the_end.used == [CHUNK - 100]
  roomy = ChunkedStack(0)
  roomy.push(200)
  roomy.pop()
  assert roomy.mapped == 0

  def recurse(k):
    return 0 if k == 0 else recurse(k - 1)

  mapped = simulate(lambda: recurse(200))  # far more than one chunk of frames
  assert len(mapped) == len(ALIGNMENTS) and min(mapped) >= 1


def test_trace_depths_quick_runs_and_returns_the_keys():
  from benchmarks import trace_depths

  result = trace_depths.measure(quick=True)
  json.dumps(result)  # JSON-able
  assert set(result) == {"config", "target", "entries", "met", "worst"}
  rows = {(e["construction"], e["n"], e["caller_depth"]) for e in result["entries"]}
  assert rows == {
    (c, n, d)
    for c in trace_depths.CONSTRUCTIONS
    for n in trace_depths.QUICK["depths"]
    for d in trace_depths.QUICK["callers"]
  }
  for e in result["entries"]:
    for run in ("sr", "raw", "raw_roomy"):
      assert len(e[run]["samples"]) == trace_depths.QUICK["reps"] and e[run]["min"] > 0
    assert e["ratio_min"] <= e["ratio"] <= e["ratio_max"] and e["ratio_to_roomy_raw"] > 0
    assert e["met"] == (e["ratio"] <= result["target"])
    calls = e["python_calls"]
    assert calls["raw"] > 0 and e["calls_ratio"] == calls["sr"] / calls["raw"]
  assert result["met"] == all(e["met"] for e in result["entries"])
  text = trace_depths.markdown(result)
  assert text.count("\n| remat_scan d=3 |") == len(trace_depths.QUICK["callers"])


def test_pytree_flatten_quick_mode_measures_every_model_and_library():
  from benchmarks import pytree_flatten

  result = pytree_flatten.measure(quick=True)
  json.dumps(result)  # JSON-able
  assert set(result["models"]) == {"scan", "list", "blocks"}
  for m in result["models"].values():
    assert set(m["flatten_us"]) == {"sr", "equinox", "nnx", "dict"}
    assert set(m["dispatch_us"]) == {"module", "state"}
    assert all(
      s["min"] <= s["median"] <= s["max"] and s["min"] > 0
      for s in [*m["flatten_us"].values(), *m["dispatch_us"].values()]
    )
    assert m["flatten_ratio"] > 0 and m["dispatch_ratio"] > 0
    assert m["leaves"]["sr"] == m["variables"] > 0
  table = pytree_flatten.markdown(result)
  assert "sr / equinox" in table and "module / State" in table
  assert table.count("met") + table.count("missed") >= 6


def test_planner_part_sets_each_candidate_against_xla(tmp_path):
  # The whole part takes a minute on 2 cores: two of its blocks show its plumbing;
  # tests/test_remat_plan_blocks.py checks the planner itself on attention blocks.
  from benchmarks import planner

  result = planner.run(True, tmp_path, only=("conv", "Dense + tanh"), log=lambda *a: None)
  assert json.loads((tmp_path / "planner.json").read_text()) == json.loads(json.dumps(result))
  rows = result["rows"]
  assert {r["block"] for r in rows} == {"conv", "Dense + tanh"}
  for r in rows:
    assert r["measured"] > 0 and abs(r["error"]) <= planner.TARGET  # else run raised
  assert [r["rank"] for r in rows if r["block"] == "conv"] == list(range(1 + planner.QUICK["next"]))
  text = (tmp_path / "planner.md").read_text()
  assert "| conv | 6 layers | 0 |" in text and "target |error| <= 10 %: met." in text


def test_auto_policy_part_compares_every_method_at_every_budget(tmp_path):
  # The conv block shows the plumbing; tests/test_auto_policy.py checks the planner.
  from benchmarks import auto_policy

  result = auto_policy.run(True, tmp_path, only=("conv",), log=lambda *a: None)
  assert json.loads((tmp_path / "auto_policy.json").read_text()) == json.loads(json.dumps(result))
  (block,) = result["blocks"]
  assert len(block["rows"]) == auto_policy.QUICK["budgets"] and block["frontier"]
  for row in block["rows"]:
    assert row["auto"]["fits"] and row["exhaustive"]["fits"]  # else run raised
  assert result["planning"]["compiles"] >= 2
  assert "Targets: all met." in (tmp_path / "auto_policy.md").read_text()


def test_offload_benchmark_runs_and_on_cpu_moves_nothing(tmp_path):
  # For a GPU session: on CPU it shows every construction runs with equal gradients.
  from benchmarks import offload

  with pytest.warns(UserWarning, match="nothing is offloaded"):
    result = offload.run(True, tmp_path, log=lambda *a: None)
  assert json.loads((tmp_path / "offload.json").read_text()) == json.loads(json.dumps(result))
  assert [r["construction"] for r in result["rows"]] == [
    "remat_scan (2, 4)",
    "remat_scan (8,)",
    "scan(remat)",
  ]
  for r in result["rows"]:
    assert r["grad_difference"] == 0.0 and r["offloaded"] > 0
    assert r["drop"] == 0 and r["offload"]["host_temp"] == 0  # the CPU moves nothing
  assert not result["config"]["moves"]
  assert "would not help: this backend (cpu)" in result["planning"]["error"]
  assert "| remat_scan (8,) |" in (tmp_path / "offload.md").read_text()


def test_pattern_part_runs_every_implementation_at_every_depth(tmp_path):
  # --part pattern needs no results.json: it writes its own two files.
  from benchmarks import pattern

  result = suite.run_part("pattern", quick=True, out=tmp_path, log=lambda *a: None)
  assert json.loads((tmp_path / "pattern.json").read_text()) == json.loads(json.dumps(result))
  q = pattern.QUICK
  entries = {(e["implementation"], e["n"]): e for e in result["entries"]}
  assert set(entries) == {(i, n) for i in pattern.IMPLEMENTATIONS for n in q["depths"]}
  for (_, n), e in entries.items():
    assert e["status"] == "ok" and e["bytes"]["temp"] > 0
    assert len(e["first_call_s"]["samples"]) == q["reps"] and e["first_call_s"]["min"] > 0
    assert e["ratio"]["temp"] > 0 and e["ratio"]["first_call"] > 0
    if n in q["step_depths"]:
      assert len(e["step_ms"]["samples"]) == q["calls"][n] and e["ratio"]["step"] > 0
    else:
      assert "step_ms" not in e
  temp = [t for t in result["targets"] if t["figure"].startswith("temp")]
  assert {(t["implementation"], t["n"]) for t in temp} == {
    (i, n) for i in ("sr", "sr_d2") for n in q["depths"]
  }
  assert all(t["met"] for t in temp)  # else run_part would have raised
  assert {t["implementation"] for t in result["targets"] if t["n"] == "all"} == {"sr", "sr_d2"}
  text = (tmp_path / "pattern.md").read_text()
  # a row per depth (the timing targets' rows are left out: times are not tested)
  for n in q["depths"]:
    assert f"| {n} | statefulremat |" in text, n


def test_pattern_implementations_compute_the_same_gradients():
  import jax
  import numpy as np

  import statefulremat as sr
  from benchmarks import pattern

  cfg = pattern.Config(6, d=8, heads=2, seq=4, batch=2)
  cases = pattern.build(cfg)
  grads = {name: case.new()(*case.args) for name, case in cases.items()}
  for name in ("sr", "sr_d2"):
    grads[name] = pattern.as_raw(grads[name])
  period = len(pattern.PATTERN)
  grads["unrolled"] = [
    jax.tree.map(lambda *a: np.stack(a), *grads["unrolled"][k::period]) for k in range(period)
  ]
  assert float(np.abs(grads["raw"][2]["attn"]["query"]["kernel"]).max()) > 1e-6
  for name in ("sr", "raw_d2", "sr_d2", "unrolled"):
    assert jax.tree.structure(grads[name]) == jax.tree.structure(grads["raw"]), name
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads[name], grads["raw"]
    )
  assert isinstance(cases["sr"].args[0], sr.Module)


def test_pipeline_part_measures_bytes_and_bubbles_on_8_devices(tmp_path):
  # --part pipeline runs benchmarks/pipeline.py in its own process (8 host devices).
  from benchmarks import pipeline

  result = suite.run_part("pipeline", quick=True, out=tmp_path, log=lambda *a: None)
  assert json.loads((tmp_path / "pipeline.json").read_text()) == result
  assert result["config"]["devices"] == 8
  q = pipeline.QUICK
  want = {
    (m, s, k) for m in pipeline.MESHES for s, _ in pipeline.SCHEDULES for k in q["microbatches"]
  }
  entries = {(e["mesh"], e["schedule"], e["microbatches"]): e for e in result["entries"]}
  assert set(entries) == want
  for e in entries.values():
    # parameters split over the stages; the compiled bytes are per device
    assert e["param_ratio"] == pytest.approx(1 / e["stages"])
    assert e["per_device_checked"]
    assert e["bytes"]["temp"] > 0 and e["temp_predicted"] > 0
    b = e["bubble"]
    assert b["work"] == b["work_expected"] == e["microbatches"] * e["repeats"] * e["stages"]
    assert b["measured"] == pytest.approx(b["spec"])
    if e["microbatches"] >= e["stages"]:
      assert b["measured"] == pytest.approx(b["formula"])
    assert len(e["step_ms"]["pipeline"]["samples"]) == q["calls"] and e["step_ratio"] > 0
  text = (tmp_path / "pipeline.md").read_text()
  assert "| stage=8 | circular R=2 | 4 |" in text and "checked for every row" in text
