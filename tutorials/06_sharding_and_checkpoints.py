# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 6. Sharding and checkpoints
#
# statefulremat does not have its own parallelism: it uses JAX's SPMD. Each
# {py:class}`Variable <statefulremat.Variable>` names its axes with *logical* names in its
# `sharding` metadata (`"embed"`, `"mlp"`), a list of rules maps logical names to the axes of a
# device mesh (`"data"`, `"model"`), and `jax.jit` partitions the computation. Then a model is saved
# with {py:func}`sr.save <statefulremat.save>` and read back with
# {py:func}`sr.restore <statefulremat.restore>`, onto any placement and, for a
# {py:func}`remat_scan <statefulremat.remat_scan>` stack, with any `lengths`.
#
# No cluster is needed to follow along: XLA can pretend the CPU is 8 devices. The first
# cell asks for that (and for the CPU) before JAX is imported; in a notebook, restart
# the kernel if JAX was already imported. On a machine with 8 accelerators, skip it.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
DIM = 16
LENGTHS, OTHER_LENGTHS = ((2, 2), (4,)) if QUICK else ((10, 10), (4, 25))
STEPS = 3 if QUICK else 20
OUT = pathlib.Path(os.environ.get("SR_TUTORIAL_OUT", "tutorial_out"))
print(len(jax.devices()), "devices:", jax.devices()[:2], "...")

# %% [markdown]
# ## Logical axis names
#
# Every [`sr.nn`](/api/nn.rst) layer takes `*_metadata` dicts for its Variables. A block whose
# hidden layer has `2 * DIM` features (`"mlp"`) between two `DIM`-wide ones (`"embed"`):


# %%
class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    embed = {"sharding": ("embed",)}
    self.norm = sr.nn.LayerNorm(dim, scale_metadata=embed, bias_metadata=embed, rngs=rngs)
    self.up = sr.nn.Linear(
      dim,
      2 * dim,
      kernel_metadata={"sharding": ("embed", "mlp")},
      bias_metadata={"sharding": ("mlp",)},
      rngs=rngs,
    )
    self.down = sr.nn.Linear(
      2 * dim, dim, kernel_metadata={"sharding": ("mlp", "embed")}, bias_metadata=embed, rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(self.norm(x))))


Stack = sr.remat_scan(Block, lengths=LENGTHS, metadata_params={"partition_name": "layers"})
stack = Stack(DIM, rngs=sr.Rngs(0))
specs = sr.get_partition_spec(stack)  # a State of PartitionSpecs, by path
print("up.kernel  ", stack.up.kernel.shape, specs["up"]["kernel"])
print("down.bias  ", stack.down.bias.shape, specs["down"]["bias"])  # pyright: ignore[reportOptionalMemberAccess]  (use_bias=False: None)

# %% [markdown]
# ## From logical names to a mesh
#
# A mesh arranges the 8 devices as 2 x 4: `"data"` splits the batch, `"model"` splits
# the `"mlp"` features. Rules name, for each logical axis, a mesh axis (or `None`:
# replicated). {py:func}`sr.logical_to_mesh <statefulremat.logical_to_mesh>` applies them;
# {py:func}`sr.shard <statefulremat.shard>` applies them and moves every array of the model to its
# `NamedSharding`, in place.

# %%
# Auto axes: jax.jit chooses the intermediate shardings. (jax.make_mesh's default in
# recent JAX, Explicit axes, makes shardings part of array types instead.)
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
rules = [("batch", "data"), ("mlp", "model"), ("embed", None), ("layers", None)]
print("mesh spec of up.kernel:", sr.logical_to_mesh(specs["up"]["kernel"], rules))

stack = sr.shard(stack, mesh, rules)  # in place, and returns the model
kernel = stack.up.kernel.value
print(
  "up.kernel is now",
  kernel.sharding.spec,  # pyright: ignore[reportAttributeAccessIssue]  (jax types .sharding as Sharding)
  "over",
  len(kernel.devices()),
  "devices;",
  "each holds",
  kernel.addressable_shards[0].data.shape,
)

# %% [markdown]
# ## A data- and model-parallel training step
#
# The step is the one from tutorial 1. Only the inputs change: the batch is split over
# `"data"`. `jax.jit` (inside {py:func}`sr.jit <statefulremat.jit>`) partitions the whole step from
# the shardings of its inputs. The result is what one device computes, up to floating-point rounding
# (the sums are split differently):


# %%
@sr.jit
def train_step(model, opt, x, y):
  loss, grads = sr.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  opt.update(grads)
  return loss


inputs = np.random.default_rng(0).standard_normal((8, DIM)).astype(np.float32)
x, y = jnp.asarray(inputs), jnp.asarray(np.sin(inputs))

single = Stack(DIM, rngs=sr.Rngs(0))  # the same initial values, on one device
single_opt = sr.Optimizer(single, optax.adam(1e-3))
opt = sr.Optimizer(stack, optax.adam(1e-3))
batch = NamedSharding(mesh, P("data"))
x_sharded, y_sharded = jax.device_put(x, batch), jax.device_put(y, batch)
for step in range(STEPS):
  loss = train_step(stack, opt, x_sharded, y_sharded)
  loss_single = train_step(single, single_opt, x, y)
  if step % 5 == 0 or step == STEPS - 1:
    print(f"step {step:2d}: loss {float(loss):.6f} on 8 devices, {float(loss_single):.6f} on one")
print(
  "up.kernel still",
  stack.up.kernel.value.sharding.spec,  # pyright: ignore[reportAttributeAccessIssue]  (jax types .sharding as Sharding)
  "| same values as one device:",
  np.allclose(stack.up.kernel.value, single.up.kernel.value, atol=1e-6),
)

# %% [markdown]
# ## JAX's default mesh: Explicit axes
#
# `jax.make_mesh` makes `AxisType.Explicit` axes by default: an array's sharding is
# part of its type (`jax.typeof(x)` shows `float32[8@data,16]`), and an op whose
# output placement is ambiguous must be told it. Every `sr.nn` layer does that from the
# shardings of its input and its parameters (the batch axes of the input, the feature
# axes of the kernel), so the same step runs unchanged. Trace it under the mesh
# (`jax.set_mesh`): there the mesh is part of the types.

# %%
explicit = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, the default
with jax.set_mesh(explicit):
  typed = Stack(DIM, rngs=sr.Rngs(0))
  sr.shard(typed, explicit, rules)
  typed_opt = sr.Optimizer(typed, optax.adam(1e-3))
  batch_explicit = NamedSharding(explicit, P("data"))
  xe, ye = jax.device_put(x, batch_explicit), jax.device_put(y, batch_explicit)
  losses = [float(train_step(typed, typed_opt, xe, ye)) for _ in range(STEPS)]
print(
  "Explicit axes:",
  jax.typeof(typed.up.kernel.value),
  "| last loss",
  f"{losses[-1]:.6f} (Auto axes: {float(loss):.6f})",
)

# %% [markdown]
# ## Sharded init: no device holds a whole array
#
# Built eagerly, a model lives on one device before `sr.shard` spreads it, so it must
# fit there. Built inside `sr.jit`, it never exists whole: `sr.shard` inside the trace
# constrains every Variable, XLA partitions the random draws, and `sr.jit` returns the
# module with every array already in its sharding. XLA's memory analysis (per device)
# shows it: the outputs are the shards, not the model.
#
# Under Explicit axes a draw's sharding is its type, and one drawn replicated is
# computed whole before it is re-typed; so build under an Auto-axes mesh of the same
# devices, and `sr.shard` the result onto the Explicit mesh (no data moves).


# %%
def create():
  model = Stack(DIM, rngs=sr.Rngs(0))
  sr.shard(model, mesh, rules)  # `mesh` has Auto axes
  return model


analysis = sr.jit(create).lower().compile().memory_analysis()
per_device = analysis.output_size_in_bytes  # pyright: ignore[reportOptionalMemberAccess]  (None: no analysis)
whole = sum(v.nbytes for v in jax.tree.leaves(sr.state(single)))
built = sr.jit(create)()
print(
  f"outputs per device {per_device} bytes; the whole model {whole} bytes;",
  "up.kernel:",
  built.up.kernel.value.sharding.spec,  # pyright: ignore[reportAttributeAccessIssue]  (jax types .sharding as Sharding)
)
sr.shard(built, explicit, rules)  # the same layout, now typed on the Explicit mesh
print("on the Explicit mesh:", jax.typeof(built.up.kernel.value))

# %% [markdown]
# ## Saving and restoring
#
# `sr.save(path, model)` writes every Variable with orbax-checkpoint. `sr.restore(path,
# model)` reads it into an existing model of the same structure, in place, onto that
# model's current shardings: here a fresh model on one device. (Pass a list, such as
# `[model, opt]`, to save and restore the optimizer state too.)

# %%
path = OUT / "06_checkpoint"
sr.save(path, stack)
fresh = Stack(DIM, rngs=sr.Rngs(1))
sr.restore(path, fresh)
print(
  "restored onto",
  type(fresh.up.kernel.value.sharding).__name__,
  "| equal:",
  np.array_equal(fresh.up.kernel.value, stack.up.kernel.value),
)

# %% [markdown]
# A save can run in the background: `sr.save(path, model, blocking=False)` returns a
# {py:class}`handle <statefulremat.SaveHandle>` once the arrays are copied to host memory, so
# training goes on at once (the model may change without changing what is saved);
# {py:meth}`handle.wait() <statefulremat.SaveHandle.wait>` blocks until the checkpoint is committed.
# A save is atomic: one interrupted, even killed, leaves the previous checkpoint loadable. Filters
# restore part of a checkpoint, e.g. pretrained parameters into a model whose batch statistics and
# RNG streams start fresh:

# %%
at_save = stack.down.kernel.value
handle = sr.save(OUT / "06_async", stack, blocking=False)
loss = train_step(stack, opt, x_sharded, y_sharded)  # trains on while it writes
handle.wait()
params_only = Stack(DIM, rngs=sr.Rngs(3))
sr.restore(OUT / "06_async", params_only, sr.Param)  # only the Params are read
print(
  handle,
  "| the params as they were at the save:",
  np.array_equal(params_only.down.kernel.value, at_save),
)

# %% [markdown]
# A `remat_scan` stack keeps one flat layer axis, whatever its `lengths`: the nested
# shape exists only while it runs. So a checkpoint restores into a stack with other
# `lengths` (other memory trade-off), and computes the same function:

# %%
Other = sr.remat_scan(Block, lengths=OTHER_LENGTHS, metadata_params={"partition_name": "layers"})
other = Other(DIM, rngs=sr.Rngs(2))
sr.restore(path, other)
print(
  f"lengths {LENGTHS} -> {OTHER_LENGTHS}: kernel {other.up.kernel.shape},",
  "same output:",
  np.allclose(other(x), fresh(x), atol=1e-5),
)

# %% [markdown]
# A model that does not match the checkpoint is left unchanged, and the error names
# the first variable that differs and how:

# %%
wider = sr.remat_scan(Block, lengths=LENGTHS)(2 * DIM, rngs=sr.Rngs(0))
before = wider.up.kernel.value
try:
  sr.restore(path, wider)
except sr.StateMismatchError as error:
  print(error)
print("wider is unchanged:", wider.up.kernel.value is before)

# %% [markdown]
# ## Several processes
#
# Past one machine, JAX runs one program in every process (multi-controller SPMD), and
# so does statefulremat: run the same script on every host, with
# `jax.distributed.initialize()` first (its arguments, or none where JAX detects the
# cluster: Cloud TPU, SLURM). `jax.devices()` then lists every host's devices and the
# mesh spans them all. Every host builds the model from the same seed and feeds its own
# rows of the batch; `sr.save` / `sr.restore` are called by every process, each writes
# and reads its own shards, and a checkpoint written by one number of processes
# restores in another. `tests/test_multiprocess.py` runs this on one machine, 2
# processes of 4 CPU devices each on 127.0.0.1:
#
# ```python
# jax.distributed.initialize(coordinator_address="10.0.0.1:1234",  # host 0
#                            num_processes=2, process_id=int(os.environ["RANK"]))
# mesh = jax.make_mesh((2, 4), ("data", "model"))          # all 8 devices
# model = Stack(DIM, rngs=sr.Rngs(0))                      # same seed everywhere
# sr.shard(model, mesh, rules)
# opt = sr.Optimizer(model, optax.adam(1e-3))
# sharding = NamedSharding(mesh, P("data"))
# with jax.set_mesh(mesh):
#   for step, (x_local, y_local) in enumerate(my_rows_of_each_batch):
#     x = jax.make_array_from_process_local_data(sharding, x_local)
#     y = jax.make_array_from_process_local_data(sharding, y_local)
#     loss = train_step(model, opt, x, y)
#   sr.save("/shared/ckpt", opt)                            # every process calls it
# ```
