"""sr.plan_remat true to XLA on real blocks: attention (MHA, GQA, dropout), a pattern's
cycles and a conv block, where a unit's backward pass needs far more than the terms
that change between nestings (issue 36, item 4). ``benchmarks/planner.py``'s blocks,
which it measures at full size."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import statefulremat as sr
from benchmarks.planner import GPT, ConvBlock

WIDTH, SEQ, BATCH = 32, 16, 2


class Local(GPT):
  """A block of a pattern: the sliding-window attention of Gemma 3's local layers."""

  def __call__(self, x):
    p = jnp.arange(x.shape[-2])
    window = (p[:, None] - p[None, :] < 4)[None, None]
    x = x + self.attn(self.attn_norm(x), mask=window, is_causal=True)
    return x + self.mlp(self.mlp_norm(x))


TOKENS = jax.ShapeDtypeStruct((BATCH, SEQ, WIDTH), jnp.float32)


def _stack(target, n, *args, **kwargs):
  stack = sr.remat_scan(target, length=n, lengths=(n,))
  return sr.eval_shape(lambda: stack(*args, rngs=sr.Rngs(0, dropout=1), **kwargs))


def _measured(plan, candidate) -> int:
  return dataclasses.replace(
    plan, lengths=candidate.lengths, policy_name=candidate.policy, measured_bytes=None
  ).verify()


CASES = {
  "MHA": (lambda: _stack(GPT, 8, WIDTH, 4), TOKENS),
  "GQA + dropout": (lambda: _stack(GPT, 8, WIDTH, 4, kv_heads=2, dropout=0.1), TOKENS),
  "conv": (lambda: _stack(ConvBlock, 8, 8), jax.ShapeDtypeStruct((2, 8, 8, 8), jnp.float32)),
  "pattern": (
    lambda: _stack((functools.partial(Local, WIDTH, 4), functools.partial(GPT, WIDTH, 4)), 12),
    TOKENS,
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_pick_and_the_next_candidates_are_within_ten_percent_of_xla(name):
  make, carry = CASES[name]
  stack = make()
  plan = sr.plan_remat(stack, carry)
  assert plan.measured_bytes is not None  # the pick was compiled: it is XLA's figure
  for candidate in plan.candidates[:3]:
    measured = _measured(plan, candidate)
    assert abs(candidate.temp_bytes - measured) <= 0.10 * measured, (candidate, measured)


def test_a_pattern_plan_counts_cycles_and_a_budget_error_names_the_smallest_plan():
  make, carry = CASES["pattern"]
  stack = make()
  plan = sr.plan_remat(stack, carry)
  assert plan.unit == "cycle" and plan.n == 6
  smallest = min(plan.candidates, key=lambda c: c.temp_bytes)
  need = _measured(plan, smallest)
  with pytest.raises(sr.TransformError) as error:
    sr.plan_remat(stack, carry, memory_budget=need // 2)
  message = str(error.value)
  assert "no remat plan for 6 cycles (a cycle is one pass over the pattern)" in message
  assert f"the smallest, lengths={smallest.lengths}" in message
  shown = re.search(r"needs ([0-9.]+ [KMG]iB)", message)
  assert shown is not None and shown.group(1) == sr.transforms.memory._remat_plan.format_bytes(need)


def test_a_budget_at_the_picks_measured_bytes_is_kept():
  make, carry = CASES["MHA"]
  stack = make()
  least = sr.plan_remat(stack, carry)
  budget = least.measured_bytes
  assert budget is not None
  plan = sr.plan_remat(stack, carry, memory_budget=budget)
  assert plan.measured_bytes is not None and plan.measured_bytes <= budget
  assert plan.evals <= least.evals
