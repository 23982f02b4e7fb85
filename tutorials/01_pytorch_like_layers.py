# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 1. PyTorch-like layers
#
# In statefulremat a layer is a plain Python object that owns its parameters, as in
# PyTorch: `__init__` creates them eagerly (there is no `super().__init__()` to call),
# `__call__` uses them. Every array the model holds sits in a
# **{py:class}`Variable <statefulremat.Variable>`**, and the Variable's kind says which
# **{term}`collection`** it belongs to: {py:class}`sr.Param <statefulremat.Param>` (`"params"`),
# {py:class}`sr.BatchStat <statefulremat.BatchStat>` (`"batch_stats"`), the RNG keys and counters
# (`"rngs"`). This tutorial builds a small network, takes it apart and puts it back, switches
# between training and evaluation, and trains it.

# %%
import os

import jax
import jax.numpy as jnp
import optax

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
STEPS = 200 if QUICK else 1000  # training steps
WIDTH = 32  # hidden features
BATCH = 128

# %% [markdown]
# ## A module owns its variables
#
# [`sr.nn`](/api/nn.rst) has flax.nnx's layers (same names, shapes and numerics). Randomness comes
# from {py:class}`sr.Rngs <statefulremat.Rngs>`, a set of named PRNG streams: here `params` for
# initialisation and `dropout` for the masks. Each stream is a key and a counter;
# {py:class}`Dropout <statefulremat.nn.Dropout>` keeps the `Rngs` it was given (shared, not copied),
# so both streams are part of the model.


# %%
class MLP(sr.Module):
  def __init__(self, width, *, rngs: sr.Rngs):
    self.hidden = sr.nn.Linear(1, width, rngs=rngs)
    self.norm = sr.nn.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.drop = sr.nn.Dropout(0.1, rngs=rngs)
    self.out = sr.nn.Linear(width, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(jax.nn.gelu(self.norm(self.hidden(x)))))


model = MLP(WIDTH, rngs=sr.Rngs(params=0, dropout=1))
for path, variable in model.iter_variables():
  print(
    f"{'.'.join(path):28} {type(variable).__name__:10} {variable.collection:12} "
    f"{variable.value.shape}"
  )

# %% [markdown]
# ## split, merge, state
#
# JAX transforms take arrays, not objects. {py:func}`sr.split <statefulremat.split>` turns the
# object graph into a {py:class}`GraphDef <statefulremat.GraphDef>` (the structure: hashable, no
# arrays) and {py:class}`State <statefulremat.State>`s (pytrees of arrays, one per filter; `...`
# takes the rest). {py:func}`sr.merge <statefulremat.merge>` builds a new object graph from them;
# {py:func}`sr.state <statefulremat.state>` reads a State without the GraphDef.

# %%
graphdef, params, rest = sr.split(model, sr.Param, ...)
print("params:", sorted(params.flat()))
print("rest:  ", sorted(rest.flat()))
print(
  "params is a pytree of",
  len(jax.tree.leaves(params)),
  "arrays, indexed by path:",
  params["hidden"]["kernel"].shape,
)

copy = sr.merge(graphdef, params, rest)
print("merge builds a new object:", copy is not model)
same = bool(jnp.all(copy.out.kernel.value == model.out.kernel.value))
print("with the same values:", same)
print("batch statistics only:", sorted(sr.state(model, sr.BatchStat).flat()))

# %% [markdown]
# ## Training and evaluation mode
#
# {py:class}`BatchNorm <statefulremat.nn.BatchNorm>` has a `use_running_average` flag and `Dropout`
# a `deterministic` flag. {py:meth}`model.train() <statefulremat.Module.train>` sets both to `False`
# throughout the model, {py:meth}`model.eval() <statefulremat.Module.eval>` sets both to `True`. In
# training mode BatchNorm normalises with the batch's statistics and updates its running averages,
# and Dropout draws a new mask on every call.
#
# `model(x)` works as it is, op by op. JAX compiles every new operation on first use,
# though, so we wrap the call in {py:func}`sr.jit <statefulremat.jit>`: one compiled program per
# mode, and every change the call makes (statistics, RNG counters) is written back to `model` just
# the same.

# %%
forward = sr.jit(lambda model, x: model(x))
x = jnp.linspace(-3.0, 3.0, BATCH).reshape(BATCH, 1)

model.train()
before = model.norm.mean.value
a, b = forward(model, x), forward(model, x)
print("train: running mean moved:", not bool(jnp.allclose(before, model.norm.mean.value)))
print("train: two calls differ (new dropout masks):", not bool(jnp.allclose(a, b)))

model.eval()
print("eval flags:", model.norm.use_running_average, model.drop.deterministic)
before = model.norm.mean.value
a, b = forward(model, x), forward(model, x)
print("eval: running mean unchanged:", bool(jnp.array_equal(before, model.norm.mean.value)))
print("eval: two calls equal:", bool(jnp.array_equal(a, b)))

# %% [markdown]
# ## A training loop
#
# The task: fit `y = sin(2x) + x/2` on `[-3, 3]`. {py:class}`sr.Optimizer <statefulremat.Optimizer>`
# wraps an optax transformation and holds its state; by default it updates the `sr.Param`s.
# {py:func}`sr.value_and_grad <statefulremat.value_and_grad>` differentiates with respect to the
# Params and returns the gradients as a `State` shaped like them. `sr.jit` compiles the whole step
# with `jax.jit` and writes every change back into `model` and `opt`: parameters, optimizer
# state, BatchNorm statistics and the dropout stream's counter.


# %%
@jax.jit
def make_batch(key):
  x = jax.random.uniform(key, (BATCH, 1), minval=-3.0, maxval=3.0)
  return x, jnp.sin(2.0 * x) + 0.5 * x


@sr.jit
def train_step(model, opt, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = sr.value_and_grad(loss_fn)(model)
  opt.update(grads)
  return loss


@sr.jit
def test_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


model = MLP(WIDTH, rngs=sr.Rngs(params=0, dropout=1))
opt = sr.Optimizer(model, optax.adam(1e-2))
x_test, y_test = make_batch(jax.random.key(123))
print(f"test loss before training: {float(test_loss(model.eval(), x_test, y_test)):.4f}")

model.train()
keys = jax.random.split(jax.random.key(0), STEPS)
window = []
for step in range(STEPS):
  window.append(train_step(model, opt, *make_batch(keys[step])))
  if len(window) == STEPS // 5:
    print(
      f"steps {step + 1 - len(window):4d}-{step:4d}  mean train loss "
      f"{float(jnp.mean(jnp.stack(window))):.4f}"
    )
    window = []

# %% [markdown]
# The step counter, the dropout stream and the running statistics all advanced in
# place, although `train_step` returned only the loss. Evaluation mode uses the running
# statistics and no dropout:

# %%
print("optimizer steps:", int(opt.step.value))
dropout_rngs = model.drop.rngs
assert isinstance(dropout_rngs, sr.Rngs)  # the model's Rngs, handed to Dropout above
print("dropout keys drawn:", int(dropout_rngs.dropout.count.value))
print("running mean, first 4:", [round(v, 3) for v in model.norm.mean.value[:4].tolist()])
print(f"test loss after training: {float(test_loss(model.eval(), x_test, y_test)):.4f}")
