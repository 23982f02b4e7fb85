# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 5. Inspecting models with treescope
#
# Every statefulremat object (modules, {py:class}`Variable <statefulremat.Variable>`s,
# {py:class}`State <statefulremat.State>`, {py:class}`GraphDef <statefulremat.GraphDef>`) renders
# through [treescope](https://treescope.readthedocs.io): as text in a terminal, as a foldable tree
# in a notebook. A stacked model (built by {py:func}`scan <statefulremat.scan>`,
# {py:func}`remat_scan <statefulremat.remat_scan>` or {py:func}`vmap <statefulremat.vmap>`) names
# its layer axis, so a `(100, 8, 8)` kernel reads as 100 layers of `8 x 8`, not as a
# three-dimensional weight. This tutorial prints a small model, a stacked one, its summary table and
# one of its layers, and writes the interactive view to an HTML file.
#
# In a notebook, one line makes treescope draw every output, arrays as figures:
# `treescope.basic_interactive_setup(autovisualize_arrays=True)` (a script has no
# notebook to set up, so this one skips it).

# %%
import builtins

import treescope

if hasattr(builtins, "get_ipython"):  # in a notebook (IPython), not as a script
  treescope.basic_interactive_setup(autovisualize_arrays=True)

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
LAYERS = 12 if QUICK else 100
DIM = 8
OUT = pathlib.Path(os.environ.get("SR_TUTORIAL_OUT", "tutorial_out"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## `repr` is treescope's text
#
# `repr` gives the compact text: an array that would take several lines is summarised
# on one (dtype, shape, mean, standard deviation, range). A Variable shows its kind and
# its metadata, here the logical axis names in `sharding` that tutorial 6 uses to place
# arrays on devices.

# %%
layer = sr.nn.Linear(2, 3, kernel_metadata={"sharding": ("embed", "mlp")}, rngs=sr.Rngs(0))
print(repr(layer))

# %% [markdown]
# `treescope.render_to_text` gives the full text, small arrays printed in full. A
# `State` shows only the variables, keyed by path. (In a notebook that draws arrays as
# figures, the text writes each figure as the line it folds to: dtype, shape and
# statistics.)

# %%
print(treescope.render_to_text(layer.kernel))
print(treescope.render_to_text(sr.state(layer)))

# %% [markdown]
# ## A stacked model names its layer axis
#
# {py:func}`sr.display <statefulremat.display>` draws a model: in a notebook as a foldable tree
# where stacked arrays are figures with the layer axis labelled; in a script it prints the text.
# Shapes read in `.shape` order with each named axis named in place: `float32(layers:12, 8)` is a
# bias of 8 features in each of 12 layers, and the kernel's other two axes take their names
# from its `sharding` metadata: `float32(layers:12, embed:8, mlp:8)`. The layer axis is
# called `layers` unless `metadata_params={"partition_name": ...}` names it otherwise.
# The stack names the class it stacks and how many layers: `Scan[Block] × 12`. Every
# array shows its statistics (mean, standard deviation, range), the big ones too.


# %%
class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, kernel_metadata={"sharding": ("embed", "mlp")}, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x))), None


Stack = sr.scan(
  Block,
  length=LAYERS,
  variable_axes={sr.Param: 0, sr.BatchStat: 0},
  split_rngs={"params": True},
  metadata_params={"partition_name": "layers"},
)


class Net(sr.Module):
  def __init__(self, *, rngs):
    self.embed = sr.nn.Linear(3, DIM, rngs=rngs)
    self.blocks = Stack(DIM, rngs=rngs)
    self.head = sr.nn.Linear(DIM, 1, rngs=rngs)

  def __call__(self, x):
    h, _ = self.blocks(self.embed(x))
    return self.head(h)


net = Net(rngs=sr.Rngs(0))
sr.display(net.blocks)

# %% [markdown]
# The partition name also goes into the stacked variables' `sharding` metadata, in
# front of the names each layer gave (without it, the metadata keeps the layer's names):

# %%
print("stacked kernel:", net.blocks.linear.kernel.shape, net.blocks.linear.kernel.sharding)

# %% [markdown]
# ## A summary table
#
# {py:func}`sr.summary(model, *inputs) <statefulremat.summary>` lists every module path with its
# class, parameter count, bytes per collection and output shapes. The call is traced with
# `jax.eval_shape`, so nothing is computed and the model's state does not change; inputs may be
# `jax.ShapeDtypeStruct`s. A stacked row counts `layers x per layer`.

# %%
print(sr.summary(net, jax.ShapeDtypeStruct((16, 3), jnp.float32)))

# %% [markdown]
# ## One layer as an ordinary module
#
# `stack.layer(i)` returns layer `i` as a plain `Block` (a copy): its arrays have lost
# the layer axis, and its metadata the partition name.

# %%
layer3 = net.blocks.layer(3)
print(type(layer3).__name__, layer3.linear.kernel.shape, layer3.linear.kernel.sharding)
print(
  "equals slice 3 of the stack:",
  np.array_equal(layer3.linear.kernel.value, net.blocks.linear.kernel.value[3]),
)
print(repr(layer3.norm.mean))

# %% [markdown]
# ## The interactive view as an HTML file
#
# `sr.display(model, path=...)` writes a self-contained page: open it in a browser to
# fold and unfold the tree. A stacked array whose layer is 0-d or 1-d (a bias, the
# BatchNorm statistics) is drawn as one layers × features image, so how the layers
# differ shows at a glance; a bigger one (a kernel) one layer at a time with a slider,
# the L2 norm of each layer beside it. Where no script runs (JavaScript off, a static
# preview) the page shows the tree as text.

# %%
path = OUT / "05_net.html"
sr.display(net, path=path)
print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
