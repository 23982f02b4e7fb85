# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 10. Pipeline parallelism over a stack
#
# A {py:func}`remat_scan <statefulremat.remat_scan>` stack keeps all its layers in one set of arrays
# with a leading layer axis. Shard that axis over a mesh axis `"stage"` and each group of devices
# holds a quarter of the layers; {py:func}`sr.pipeline <statefulremat.pipeline>` then runs the stack
# as a pipeline: the batch is cut into microbatches, stage 0 works on microbatch 0, hands its
# activations to stage 1 (a `ppermute`) and takes microbatch 1, and so on. It is one SPMD program
# under `jax.jit` (a `shard_map` over `"stage"`), so it composes with a `"data"` axis of the
# same mesh, with {py:func}`sr.grad <statefulremat.grad>`, {py:func}`sr.jit <statefulremat.jit>` and
# {py:class}`sr.Optimizer <statefulremat.Optimizer>`.
#
# The promise checked in this tutorial: the pipelined run equals the same stack run
# sequentially, microbatch after microbatch, to the last bit of its dropout masks; and
# each device holds only its stage's layers. Then the two schedules (GPipe and
# circular) and their idle "bubbles", what each device holds and scratches, and
# {py:func}`sr.accumulate <statefulremat.accumulate>`, the one-device way to a big batch.
#
# As in tutorial 6, XLA pretends the CPU is 8 devices; the first cell asks for that
# before JAX is imported (in a notebook, restart the kernel if JAX was already
# imported). On a machine with 8 accelerators, skip it.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
STAGES, DATA = 4, 2
LAYERS = 8  # two per stage (GPipe); one per stage and pass (circular, 2 passes)
DIM, HEADS, SEQ, VOCAB = (32, 2, 16, 64) if QUICK else (64, 4, 32, 64)
BATCH, MICROBATCHES = (16, 4) if QUICK else (32, 8)
TRAIN_STEPS = 3 if QUICK else 40
DROPOUT = 0.1
print(len(jax.devices()), "devices:", jax.devices()[:2], "...")

# %% [markdown]
# ## The model: pre-LN blocks in a remat_scan stack
#
# A block is `x + drop(attn(ln1(x)))` then `x + drop(mlp(ln2(x)))`. Every
# {py:class}`Variable <statefulremat.Variable>` names its axes in `sharding` metadata (tutorial 6),
# and `metadata_params={"partition_name": "layers"}` names the stack's layer axis
# `"layers"`: that is the axis the stages split. The language model around the stack
# (token embedding, final LayerNorm, logits read off the embedding) is small and stays
# replicated; `blocks` says how the stack is run, so the same model runs pipelined or
# sequentially.


# %%
def names(*axes):
  return {"sharding": axes}


class Block(sr.Module):
  def __init__(self, *, rngs):
    embed = names("embed")
    self.ln1 = sr.nn.LayerNorm(DIM, scale_metadata=embed, bias_metadata=embed, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(
      HEADS,
      DIM,
      kernel_metadata=names("embed", "heads", "kv"),
      bias_metadata=names("heads", "kv"),
      out_kernel_metadata=names("heads", "kv", "embed"),
      out_bias_metadata=embed,
      rngs=rngs,
    )
    self.ln2 = sr.nn.LayerNorm(DIM, scale_metadata=embed, bias_metadata=embed, rngs=rngs)
    self.mlp = sr.nn.MLP(
      DIM,
      4 * DIM,
      kernel_metadata=names("embed", "mlp"),
      bias_metadata=names("mlp"),
      out_kernel_metadata=names("mlp", "embed"),
      out_bias_metadata=embed,
      rngs=rngs,
    )
    self.drop = sr.nn.Dropout(DROPOUT, rngs=rngs)

  def __call__(self, x):
    x = x + self.drop(self.attn(self.ln1(x), is_causal=True))
    return x + self.drop(self.mlp(self.ln2(x)))


Blocks = sr.remat_scan(Block, lengths=(LAYERS,), metadata_params={"partition_name": "layers"})


def whole(blocks, h):
  return blocks(h)


class LM(sr.Module):
  def __init__(self, *, rngs):
    self.embed = sr.nn.Embed(VOCAB, DIM, embedding_metadata=names("vocab", "embed"), rngs=rngs)
    self.blocks = Blocks(rngs=rngs)
    self.ln = sr.nn.LayerNorm(
      DIM, scale_metadata=names("embed"), bias_metadata=names("embed"), rngs=rngs
    )

  def __call__(self, tokens, blocks=whole):
    return self.embed.attend(self.ln(blocks(self.blocks, self.embed(tokens))))


def build():
  return LM(rngs=sr.Rngs(params=0, dropout=1))


model = build()
print(
  "fc1 kernel:",
  model.blocks.mlp.fc1.kernel.shape,
  sr.get_partition_spec(model)["blocks"]["mlp"]["fc1"]["kernel"],
)

# %% [markdown]
# ## The mesh: 4 stages x 2 data-parallel replicas
#
# The 8 devices form a `(stage=4, data=2)` mesh. The rules send the layer axis to
# `"stage"` and the batch to `"data"`; the feature axes stay whole on each device
# (add a `"model"` axis to the mesh and a rule such as `("mlp", "model")` for tensor
# parallelism on top). {py:func}`sr.shard <statefulremat.shard>` moves every array to its place:
# each device now holds 2 of the 8 layers.

# %%
mesh = jax.make_mesh((STAGES, DATA), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
rules = [
  ("layers", "stage"),
  ("batch", "data"),
  ("embed", None),
  ("mlp", None),
  ("heads", None),
  ("kv", None),
  ("vocab", None),
]
sr.shard(model, mesh, rules)


def build_sharded():
  model = build()
  sr.shard(model, mesh, rules)
  return model


kernel = model.blocks.mlp.fc1.kernel.value
print(
  "fc1 kernel:",
  kernel.sharding.spec,  # pyright: ignore[reportAttributeAccessIssue]  (jax types .sharding as Sharding)
  "; device 0 holds",
  kernel.addressable_shards[0].data.shape,
  "of",
  kernel.shape,
)

# A copy-the-first-half task: the second half of every sequence repeats the first.
rng = np.random.default_rng(0)


def batch(size=BATCH):
  half = rng.integers(0, VOCAB, (size, SEQ // 2 + 1))
  tokens = np.concatenate([half, half], axis=1)[:, : SEQ + 1].astype(np.int32)
  return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


x, y = batch()
on_data = NamedSharding(mesh, P("data"))
x_sharded = jax.device_put(x, on_data)

# %% [markdown]
# ## The pipelined forward equals the sequential microbatch-by-microbatch run
#
# `sr.pipeline(fn, microbatches=k)` takes the same `fn(layer, carry) -> carry` as
# `sr.remat_scan`; called on the stack and the activations inside `jax.set_mesh`, it
# splits the batch into `k` contiguous microbatches and pipelines them over `"stage"`.
#
# What it equals: the stack run on microbatch 0, then 1, ... in turn — per layer the
# state sees the microbatches in order, and the dropout stream advances once per
# microbatch, so each microbatch draws that run's masks. That reference runs on one
# device from the same seeds. Dropout is on (training mode), so equality here covers
# the masks too.


# %%
def apply(layer, h):
  return layer(h)


def piped():
  """The blocks run as a GPipe pipeline over "stage"."""
  return sr.pipeline(apply, microbatches=MICROBATCHES)


def sequential(blocks, h):
  """The reference: the whole stack on each microbatch in turn."""
  scan = sr.remat_scan(apply, lengths=(LAYERS,))
  return jnp.concatenate([scan(blocks, mb) for mb in jnp.split(h, MICROBATCHES)])


def max_difference(a, b):
  """The largest difference over two models' arrays (keys compared as their data)."""

  def flat(m):
    return {
      path: np.asarray(
        jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v, np.float64
      )
      for path, v in sr.state(m).flat().items()
    }

  fa, fb = flat(a), flat(b)
  assert fa.keys() == fb.keys()
  return max(float(np.max(np.abs(fa[p] - fb[p]))) for p in fa)


reference = build()  # the same seeds, on one device
forward_piped = sr.jit(lambda m, x: m(x, piped()))
forward_sequential = sr.jit(lambda m, x: m(x, sequential))
with jax.set_mesh(mesh):
  logits = forward_piped(model, x_sharded)
want = forward_sequential(reference, x)
forward_diff = float(jnp.max(jnp.abs(logits - want)))
print(
  f"logits {logits.shape}, sharded {logits.sharding.spec}; max |pipelined - "
  f"sequential| = {forward_diff:.2e}"
)
print(
  "dropout draws so far:",
  int(model.blocks.drop.rngs.dropout.count.value),  # pyright: ignore  (rngs: an Rngs here)
  "(one per microbatch); state max difference:",
  max_difference(model, reference),
)
assert forward_diff < 1e-5 and max_difference(model, reference) < 1e-6


# %% [markdown]
# ## Gradients, and training steps with sr.Optimizer
#
# Nothing new in the step: it is tutorial 1's, with the blocks run by the pipeline.
# {py:func}`sr.value_and_grad <statefulremat.value_and_grad>` differentiates through the `shard_map`
# (the backward pass runs the pipeline in reverse, with its own `ppermute`s), and `sr.Optimizer`
# updates the sharded parameters where they are.
#
# First the gradients, from fresh copies of the model. They agree to float rounding
# relative to each gradient's size. One exception proves the rule: the attention's key
# bias adds the same amount to every score of a query, which the softmax cancels, so
# its true gradient is zero and both runs return rounding noise (around 1e-9). That
# is also why the optimizer steps below use SGD: Adam divides each gradient by its own
# size, so it would turn that noise into full-size, different steps for that bias.


# %%
def loss_fn(model, x, y, blocks):
  return optax.softmax_cross_entropy_with_integer_labels(model(x, blocks), y).mean()


def gradients(model, x, y, blocks, mesh=None):
  fn = sr.jit(lambda m, x, y: sr.grad(loss_fn)(m, x, y, blocks))
  if mesh is None:
    return fn(model, x, y)
  with jax.set_mesh(mesh):
    return fn(model, jax.device_put(x, on_data), jax.device_put(y, on_data))


def relative_differences(got, want):
  """Per gradient: max |got - want| / max |want|."""
  got, want = got.flat(), want.flat()
  return {
    path: float(
      np.max(np.abs(np.asarray(got[path]) - np.asarray(want[path])))
      / np.max(np.abs(np.asarray(want[path])))
    )
    for path in want
  }


x_g, y_g = batch()
grads_piped = gradients(build_sharded(), x_g, y_g, piped(), mesh)
grads_sequential = gradients(build(), x_g, y_g, sequential)
relative = relative_differences(grads_piped, grads_sequential)
zero_gradient = ("blocks", "attn", "key", "bias")
print(
  "max relative gradient difference:",
  f"{max(v for p, v in relative.items() if p != zero_gradient):.1e};",
  "key bias: max |gradient|",
  f"{float(jnp.max(jnp.abs(grads_sequential.flat()[zero_gradient]))):.1e}",
)
assert max(v for p, v in relative.items() if p != zero_gradient) < 1e-5


# %%
def make_step(blocks):
  @sr.jit
  def step(model, opt, x, y):
    loss, grads = sr.value_and_grad(loss_fn)(model, x, y, blocks)
    opt.update(grads)
    return loss

  return step


def sgd(model):
  return sr.Optimizer(model, optax.sgd(0.1, momentum=0.9))


model, reference = build_sharded(), build()
opt, reference_opt = sgd(model), sgd(reference)
step, reference_step = make_step(piped()), make_step(sequential)
loss_diffs = []
for i in range(2):
  x, y = batch()
  with jax.set_mesh(mesh):
    loss = step(model, opt, jax.device_put(x, on_data), jax.device_put(y, on_data))
  reference_loss = reference_step(reference, reference_opt, x, y)
  loss_diffs.append(abs(float(loss) - float(reference_loss)))
  print(f"step {i}: loss {float(loss):.6f} pipelined, {float(reference_loss):.6f} sequential")
train_diff = max_difference(model, reference)
print(
  f"max loss difference {max(loss_diffs):.1e}; max parameter difference after two "
  f"steps {train_diff:.1e}; fc1 kernel still {model.blocks.mlp.fc1.kernel.value.sharding.spec}"  # pyright: ignore[reportAttributeAccessIssue]
)
assert max(loss_diffs) < 1e-5 and train_diff < 1e-5

# %% [markdown]
# And it trains: the same step, more steps on the copy task. (In the full run's 40
# steps the loss falls from about 4.66 to about 4.17, near ln 64 = 4.16, the loss of a
# uniform guess: learning to copy the first half takes many more steps than this
# tutorial spends.) Its first calls compile (twice: the first step returns some arrays with
# `PartitionSpec('stage')` where `sr.shard` wrote `PartitionSpec('stage', None, None)`,
# the same placement written differently, which `jax.jit` caches as another input
# type).

# %%
model = build_sharded()
opt = sgd(model)
start = time.perf_counter()
for i in range(TRAIN_STEPS):
  x, y = batch()
  with jax.set_mesh(mesh):
    loss = step(model, opt, jax.device_put(x, on_data), jax.device_put(y, on_data))
  if i % 10 == 0 or i == TRAIN_STEPS - 1:
    print(f"step {i:3d}: loss {float(loss):.3f}")
print(f"{TRAIN_STEPS} pipelined steps in {time.perf_counter() - start:.1f}s (the first compiles)")

# %% [markdown]
# ## GPipe and circular schedules: the bubble
#
# With S stages and k microbatches, GPipe takes k + S − 1 time steps: stage s idles
# for the first s steps (nothing has reached it yet) and the last S − 1 − s (nothing
# left). The share of idle stage steps, the *bubble*, is (S − 1)/(k + S − 1).
#
# The circular schedule (`schedule="circular", repeats=R`) cuts the stack into S·R
# chunks of consecutive layers, stage s holding chunks s, s + S, ...; a microbatch
# goes round the stages R times. Each step is R times shorter (fewer layers per
# chunk), and the bubble shrinks to (S − 1)/(R·k + S − 1), at the price of R times more
# hand-offs between stages. {py:class}`sr.PipelineSpec <statefulremat.PipelineSpec>` holds a
# schedule's settings and computes its bubble; `spec.apply(fn)` is the pipeline. Both schedules give
# the same result.

# %%
print("bubble fraction with 4 stages:")
print("   k   gpipe   circular R=2   circular R=4")
for k in (4, 8, 16, 32):
  fractions = [
    sr.PipelineSpec(microbatches=k, schedule=s, repeats=r).bubble_fraction(stages=STAGES)
    for s, r in (("gpipe", 1), ("circular", 2), ("circular", 4))
  ]
  print(f"{k:4d}   {fractions[0]:.3f}   {fractions[1]:.3f}          {fractions[2]:.3f}")

SPECS = {
  "gpipe": sr.PipelineSpec(microbatches=MICROBATCHES),
  "circular": sr.PipelineSpec(microbatches=MICROBATCHES, schedule="circular", repeats=2),
}
x, y = batch()
want = forward_sequential(build(), x)
forwards = {
  "gpipe": forward_piped,  # the same pipeline as SPECS["gpipe"].apply(apply)
  "circular": sr.jit(lambda m, x: m(x, SPECS["circular"].apply(apply))),
}
for name, spec in SPECS.items():
  with jax.set_mesh(mesh):
    got = forwards[name](build_sharded(), jax.device_put(x, on_data))
  difference = float(jnp.max(jnp.abs(got - want)))
  print(
    f"{name:8s} (bubble {spec.bubble_fraction(stages=STAGES):.2f}): max |pipelined - "
    f"sequential| = {difference:.1e}"
  )
  assert difference < 1e-5

# %% [markdown]
# ## What each device holds, and what it scratches
#
# The point of pipelining is memory: each device holds its stage's layers only.
# `addressable_shards` shows what is on a device; summed over the model's arrays that
# is its parameter bytes (the stack's quarter, plus the small replicated embedding and
# LayerNorm). The compiled step's `memory_analysis()` gives, per device, the scratch
# (`temp`) memory of the forward and backward pass: the activations kept for the
# backward pass and the pipeline's buffers.
#
# The comparison is the unpipelined stack on one device: the whole model, the whole
# batch through one `remat_scan`. With 4 stages and 2 replicas each device holds about
# a quarter of the stack and runs a (k·2)-th of the batch through its layers per time
# step; what it keeps for the backward pass is per time step, so it grows with
# k + S − 1 (GPipe) while each step's share shrinks with k.


# %%
def bytes_on(model, device):
  """Bytes of the model's arrays that live on `device`."""
  total = 0
  for value in sr.state(model).flat().values():
    for shard in value.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def temp_bytes(step, model, opt, x, y, mesh=None):
  if mesh is None:
    return step.lower(model, opt, x, y).compile().memory_analysis().temp_size_in_bytes
  with jax.set_mesh(mesh):
    compiled = step.lower(
      model, opt, jax.device_put(x, on_data), jax.device_put(y, on_data)
    ).compile()
  return compiled.memory_analysis().temp_size_in_bytes


x, y = batch()
one_device = build()
rows = [
  (
    "one device, unpipelined",
    bytes_on(one_device, jax.devices()[0]),
    temp_bytes(make_step(whole), one_device, sgd(one_device), x, y),
  )
]
for name, spec in SPECS.items():
  model = build_sharded()
  rows.append(
    (
      f"pipelined, {name}",
      bytes_on(model, jax.devices()[0]),
      temp_bytes(make_step(spec.apply(apply)), model, sgd(model), x, y, mesh),
    )
  )
print(f"{'':26s} {'parameters':>12s} {'temp':>12s}   (bytes on device 0)")
for name, params, temp in rows:
  print(
    f"{name:26s} {params:12,d} {temp:12,d}   ({params / rows[0][1]:.2f}x, {temp / rows[0][2]:.2f}x)"
  )
stack_bytes = sum(v.nbytes for v in sr.state(one_device.blocks).flat().values())
print(
  f"the stack alone: {stack_bytes:,d} bytes on one device, "
  f"{bytes_on(build_sharded().blocks, jax.devices()[0]):,d} per device pipelined"
)
assert rows[1][1] < rows[0][1] / 2

# %% [markdown]
# The circular schedule is not free here. The stack is sharded for GPipe (stage s holds
# layers 2s and 2s + 1), while circular wants stage s to hold layers s and s + 4: the
# pipeline gathers the weights into its layout inside every step (and the gradients
# back), so its scratch memory above holds the gathered weights as well.
#
# Time: on real accelerators a bubble is time a device waits. In one SPMD program
# every device runs every time step, bubbles included (their results are thrown away),
# so a step's compute is (time steps) x (layers per chunk): (k + S − 1)·N/S for GPipe,
# (R·k + S − 1)·N/(S·R) for circular. This CPU runs all 8 simulated devices on its
# few cores, so its wall time follows that compute plus the weight gathering. Paired,
# interleaved timings of the jitted training steps (skipped in the test suite's quick
# mode, which would compile them again):

# %%
if not QUICK:
  steps, models = {}, {}
  for name, spec in SPECS.items():
    models[name] = build_sharded()
    models[name] = (models[name], sgd(models[name]))
    steps[name] = make_step(spec.apply(apply))
  x, y = (jax.device_put(a, on_data) for a in batch())
  times = {name: [] for name in SPECS}
  with jax.set_mesh(mesh):
    for _ in range(2):  # compiles (twice, see "And it trains")
      for name in SPECS:
        steps[name](*models[name], x, y).block_until_ready()
    for _ in range(7):
      for name in SPECS:
        start = time.perf_counter()
        steps[name](*models[name], x, y).block_until_ready()
        times[name].append(time.perf_counter() - start)
  k, n = MICROBATCHES, LAYERS
  compute = {
    "gpipe": (k + STAGES - 1) * n / STAGES,
    "circular": (2 * k + STAGES - 1) * n / (2 * STAGES),
  }
  for name in SPECS:
    print(
      f"{name:8s} step: median {1e3 * np.median(times[name]):.1f} ms "
      f"(min {1e3 * min(times[name]):.1f}, max {1e3 * max(times[name]):.1f}); "
      f"compute {compute[name]:.0f} layer-microbatches per stage"
    )
  print(
    f"circular / gpipe: {np.median(times['circular']) / np.median(times['gpipe']):.2f} "
    f"measured, {compute['circular'] / compute['gpipe']:.2f} from the compute alone"
  )

# %% [markdown]
# ## One device, a big batch: sr.accumulate
#
# Without a mesh to spread the layers over, the way to a batch bigger than the memory
# allows is gradient accumulation: `sr.accumulate(sr.value_and_grad(loss_fn),
# microbatches=k)` runs the microbatches one after another in a `lax.scan`, summing the
# gradients, and returns the mean loss and gradients. Like the pipeline, it carries
# every state write from one microbatch to the next (the dropout stream advances once
# per microbatch), so its gradients are the pipeline's, from the same seeds. Its
# scratch memory is that of one microbatch, where the unpipelined step's is that of
# the whole batch.


# %%
def lm_loss(model, x, y):
  return loss_fn(model, x, y, whole)


accumulated = sr.accumulate(sr.value_and_grad(lm_loss), microbatches=MICROBATCHES)


@sr.jit
def accumulate_step(model, opt, x, y):
  loss, grads = accumulated(model, x, y)
  opt.update(grads)
  return loss


model = build()
loss, grads_accumulated = sr.jit(accumulated)(model, x_g, y_g)  # the batch of grads_piped
relative = relative_differences(grads_accumulated, grads_piped)
print(
  f"accumulated vs pipelined gradients: max relative difference "
  f"{max(v for p, v in relative.items() if p != zero_gradient):.1e}"
)
assert max(v for p, v in relative.items() if p != zero_gradient) < 1e-5
model = build()
accumulate_temp = temp_bytes(accumulate_step, model, sgd(model), x, y)
print(
  f"temp on one device: {rows[0][2]:,d} bytes for the whole batch, "
  f"{accumulate_temp:,d} accumulating {MICROBATCHES} microbatches "
  f"({accumulate_temp / rows[0][2]:.2f}x)"
)

# %% [markdown]
# ## Summary
#
# - `sr.pipeline(fn, microbatches=k, schedule=..., repeats=...)(stack, x)` runs a
#   `remat_scan` stack whose layer axis is sharded over the mesh axis `"stage"` as a
#   pipeline, inside `jax.set_mesh(mesh)`; other mesh axes (here `"data"`) work as
#   before.
# - It equals the sequential microbatch-by-microbatch run: outputs, gradients, state
#   writes and dropout masks; it trains under `sr.jit` with `sr.Optimizer`.
# - {py:meth}`sr.PipelineSpec(...).bubble_fraction(stages=S) <statefulremat.PipelineSpec.bubble_fraction>`
#   gives the idle share: (S − 1)/(k + S − 1) for GPipe, (S − 1)/(R·k + S − 1) for circular.
# - Each device holds its stage's layers: parameter bytes drop by about the number of
#   stages.
# - On one device, `sr.accumulate` gets the same gradients in one microbatch's scratch
#   memory.
