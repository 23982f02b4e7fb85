"""The remat planner weighs offloading the outer levels' carries (issue 36, item 4):
only where no plan keeping them on the device meets the budget, and it says why.

CI has no backend that moves offloaded values to host memory, so the choice itself is
tested on the planner's own parts with a model that does (``moves=True``), and the
public API on CPU, where offloading helps nothing and the error says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from statefulremat.transforms.memory import _remat_budget as budget_fitting
from statefulremat.transforms.memory import _remat_plan as planning

N, CARRY, LAYER = 64, 1 << 20, 1 << 16
RESIDUALS = {planning.NOTHING: CARRY, planning.DOTS: 4 * CARRY}


def make(scales, budget, placements=("device",)):
  """A plan as sr.plan_remat makes one, on a backend that moves offloaded carries."""
  best, ranked = planning.choose(
    N, CARRY, LAYER, RESIDUALS, budget, 4, scales, "layer", None, placements, True
  )
  return planning.RematPlan(
    N,
    best.lengths,
    best.policy,
    best.evals,
    best.temp_bytes,
    budget,
    tuple(ranked),
    CARRY,
    LAYER,
    None,
    carries=best.carries,
  )


def exact(plan) -> int:  # a compile that agrees with the model
  return plan.temp_bytes


def offloading(scales, budget):
  return make(scales, budget, ("offload",))


def smallest(placement: str) -> int:
  return min(c.temp_bytes for c in make(None, None, (placement,)).candidates)


def test_an_offloaded_plan_keeps_the_outer_carries_off_the_device():
  device = {(c.lengths, c.policy): c for c in make(None, None).candidates}
  for c in make(None, None, ("offload",)).candidates:
    assert c.carries == "offload"
    assert c.host_bytes == planning.offloaded_bytes(N, c.lengths, CARRY) > 0
    # one carry stays on the device, in transit
    assert c.temp_bytes == device[c.lengths, c.policy].temp_bytes - c.host_bytes + CARRY


def test_a_budget_the_device_meets_keeps_the_carries_there():
  budget = int(smallest("device") / planning.HEADROOM) + 1
  plan = budget_fitting.fit_budget(make, budget, exact, offloading)
  assert plan.carries == "device"
  assert plan.reason.startswith("Carries on the device: recompute alone meets memory_budget=")
  assert f"lengths={plan.lengths}" in plan.reason and plan.reason in str(plan)


def test_a_budget_only_offloading_meets_offloads_and_says_why():
  budget = int(smallest("offload") / planning.HEADROOM) + 1
  assert budget < smallest("device")  # recompute alone cannot meet it
  plan = budget_fitting.fit_budget(make, budget, exact, offloading, host_bandwidth=50e9)
  assert plan.carries == "offload" and plan.temp_bytes <= budget
  host = planning.offloaded_bytes(N, plan.lengths, CARRY)
  assert "Carries offloaded: no plan keeping them on the device fits" in plan.reason
  assert f"{planning.format_bytes(host)} go out and back per step" in plan.reason
  assert f"~{1e3 * host / 50e9:.1f} ms each way at host_bandwidth=50 GB/s" in plan.reason
  assert plan.reason in str(plan) and "carries" in str(plan).splitlines()[1]


def test_among_offloading_plans_the_fewest_evaluations_then_the_least_traffic():
  budget = int(smallest("offload") * 1.5)
  assert budget < smallest("device")
  plan = budget_fitting.fit_budget(make, budget, exact, offloading)
  fitting = [c for c in plan.candidates if c.temp_bytes <= planning.HEADROOM * budget]
  fewest = min(c.evals for c in fitting)
  assert plan.evals == fewest
  assert plan.candidates[0].host_bytes == min(c.host_bytes for c in fitting if c.evals == fewest)


def test_a_budget_nothing_meets_even_offloaded_says_so():
  with pytest.raises(sr.TransformError, match=r"\(Its carries in host memory: carries='offload'"):
    budget_fitting.fit_budget(make, smallest("offload") // 2, exact, offloading)


# -- the public API on CPU, which moves nothing to host memory --------------------------


def body(layer, h):
  return jnp.tanh(layer(h))


@pytest.fixture(scope="module")
def stack():
  return sr.vmap(sr.nn.Linear, axis_size=12)(16, 16, rngs=sr.Rngs(0))


X = jax.ShapeDtypeStruct((32, 16), jnp.float32)


def test_on_cpu_a_budget_nothing_meets_says_offloading_would_not_help(stack):
  least = sr.plan_remat(stack, X, fn=body)
  with pytest.raises(sr.TransformError) as error:
    sr.plan_remat(stack, X, fn=body, memory_budget=least.measured_bytes // 3)
  assert "would not help: this backend (cpu) moves nothing to host memory" in str(error.value)
  with pytest.raises(sr.TransformError) as error:  # the user chose: nothing to add
    sr.plan_remat(stack, X, fn=body, memory_budget=least.measured_bytes // 3, carries="device")
  assert "would not help" not in str(error.value)


def test_a_plan_for_offloaded_carries_runs_with_them_offloaded(stack):
  plan = sr.plan_remat(stack, X, fn=body, carries="offload")
  assert plan.carries == "offload" and all(c.carries == "offload" for c in plan.candidates)
  # On CPU nothing moves: the prediction is the device's, true to XLA here.
  assert abs(plan.temp_bytes - plan.verify()) <= 0.1 * plan.verify()
  x = jnp.linspace(-1, 1, 32 * 16).reshape(32, 16)
  run = sr.remat_scan(body, lengths=plan)
  with pytest.warns(UserWarning, match="nothing is offloaded"):
    y = run(stack, x)
  device = sr.remat_scan(body, lengths=plan.lengths, policy=plan.policy)(stack, x)
  np.testing.assert_allclose(y, device, rtol=1e-6)
  with pytest.raises(sr.TransformError, match=r"the plan keeps its carries in 'offload'"):
    sr.remat_scan(body, lengths=plan, carries="device")


@pytest.mark.parametrize("carries", ["host", True])
def test_plan_remat_refuses_carries_that_are_not_a_choice(stack, carries):
  with pytest.raises(sr.TransformError, match=rf"carries={carries!r}; it takes 'device'"):
    sr.plan_remat(stack, X, fn=body, carries=carries)


@pytest.mark.parametrize("bandwidth", ["fast", -1, "0GB/s"])
def test_plan_remat_refuses_a_bandwidth_that_is_not_one(stack, bandwidth):
  with pytest.raises(sr.TransformError, match="host_bandwidth=.* is not an amount"):
    sr.plan_remat(stack, X, fn=body, host_bandwidth=bandwidth)
