"""sr.summary: counts equal the State's sizes, stacks give per-layer counts, output
shapes come from an abstract trace that leaves the model (and the classes) unchanged,
a shared module sits at its sr.state path, per-layer norms of Params and gradients
equal numpy's; sr.display draws stacked arrays as figures with a layer slider."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x)))


class Net(sr.Module):
  def __init__(self, rngs, lengths=(5, 4)):
    self.embed = sr.nn.Linear(3, 8, rngs=rngs)
    self.blocks = sr.remat_scan(Block, lengths=lengths)(8, rngs=rngs)
    self.head = sr.nn.Linear(8, 2, rngs=rngs)
    self.drop = sr.nn.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(self.blocks(self.embed(x))))


def param_count(model):
  return sum(x.size for x in jax.tree.leaves(sr.state(model, sr.Param)))


def snapshot(model):
  def data(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

  return sr.graphdef(model), [np.asarray(data(x)) for x in jax.tree.leaves(sr.state(model))]


def assert_unchanged(model, before):
  after = snapshot(model)
  assert after[0] == before[0]
  for a, b in zip(after[1], before[1], strict=True):
    np.testing.assert_array_equal(a, b)


def row(table, path):
  (found,) = [r for r in table.rows if r.path_text == path]
  return found


def test_totals_equal_the_sizes_in_the_param_state():
  model = Net(sr.Rngs(0))
  table = sr.summary(model, jnp.ones((4, 3)))
  assert table.total_params == param_count(model) == 3 * 8 + 8 + 20 * 88 + 18
  assert table.rows[0].params == table.total_params
  assert table.total_bytes["params"] == 4 * param_count(model)
  assert table.total_bytes["batch_stats"] == 4 * 20 * 16
  for r in table.rows:  # every row counts the Params below it
    sub = model
    for key in r.path:
      sub = sub[key] if isinstance(key, int) else getattr(sub, key)
    assert r.params == param_count(sub)


def test_stacked_rows_give_the_layer_count_and_one_layer():
  table = sr.summary(Net(sr.Rngs(0)), jnp.ones((4, 3)))
  blocks, linear = row(table, "blocks"), row(table, "blocks.linear")
  assert (blocks.layers, blocks.params_per_layer, blocks.params) == (20, 88, 1760)
  assert (linear.layers, linear.params_per_layer, linear.params) == (20, 72, 1440)
  assert blocks.params_text() == "1,760 (20 × 88)"
  root = table.rows[0]  # the stack plus unstacked embed and head
  assert root.params_text() == "1,810 (20 × 88 + 50)"
  assert row(table, "head").params_text() == "18"


def test_output_shapes_per_module_path_including_layers_inside_the_stack():
  table = sr.summary(Net(sr.Rngs(0)), jax.ShapeDtypeStruct((4, 3), jnp.float32))
  assert row(table, "(root)").outputs == ("float32[4,2]",)
  assert row(table, "embed").outputs == ("float32[4,8]",)
  assert row(table, "blocks").outputs == ("float32[4,8]",)
  # Layers run inside the scan body; their calls still land on the stack's rows.
  assert row(table, "blocks.linear").outputs_text() == "float32[4,8]"
  assert row(table, "blocks.norm").outputs_text() == "float32[4,8]"
  assert row(table, "drop.rngs.default").outputs == ("key<fry>[]",)
  assert row(table, "drop.rngs").outputs_text() == "-"


def test_the_text_table():
  class MLP(sr.Module):
    def __init__(self, rngs):
      self.hidden = sr.nn.Linear(4, 8, rngs=rngs)
      self.norm = sr.nn.BatchNorm(8, rngs=rngs)
      self.out = sr.nn.Linear(8, 2, use_bias=False, rngs=rngs)

    def __call__(self, x):
      h = self.hidden(x)
      return self.out(self.norm(h)), h

  table = sr.summary(MLP(sr.Rngs(0)), jnp.ones((16, 4)))
  assert (
    str(table)
    == """\
path    class      params  params bytes  batch_stats bytes  output
------------------------------------------------------------------------------------------
(root)  MLP            72         288 B               64 B  (float32[16,2], float32[16,8])
hidden  Linear         40         160 B                  -  float32[16,8]
norm    BatchNorm      16          64 B               64 B  float32[16,8]
out     Linear         16          64 B                  -  float32[16,2]
------------------------------------------------------------------------------------------
Total                  72         288 B               64 B"""
  )
  assert repr(table) == str(table)
  rendered = treescope.render_to_text(table)
  assert rendered.startswith("Summary(  # 72 params, 4 modules\n  path    class")
  assert "  hidden  Linear         40         160 B" in rendered
  html = treescope.render_to_html(table, compressed=False)
  assert "hidden  Linear" in html


def test_a_stack_is_named_as_the_transform_over_the_users_class():
  class Body(sr.Module):
    def __init__(self, dim, *, rngs):
      self.linear = sr.nn.Linear(dim, dim, kernel_init=jax.nn.initializers.ones, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  class Model(sr.Module):
    def __init__(self, rngs):
      self.blocks = sr.remat_scan(Body, lengths=(3,))(2, rngs=rngs)
      self.ensemble = sr.vmap(sr.nn.Linear, axis_size=2)(
        2, 2, use_bias=False, kernel_init=jax.nn.initializers.ones, rngs=rngs
      )

    def __call__(self, x):
      return self.ensemble(self.blocks(x))

  table = sr.summary(Model(sr.Rngs(0)), jnp.ones((2, 5, 2)))
  # Not the generated RematScanBody and VmapLinear: the transform and the user's class.
  assert (
    str(table)
    == """\
path           class                params  params bytes  output
------------------------------------------------------------------------
(root)         Model                    26         104 B  float32[2,5,2]
blocks         RematScan[Body]  18 (3 × 6)          72 B  float32[2,5,2]
blocks.linear  Linear           18 (3 × 6)          72 B  float32[2,5,2]
ensemble       Vmap[Linear]      8 (2 × 4)          32 B  float32[2,5,2]
------------------------------------------------------------------------
Total                                   26         104 B

blocks: RematScan[Body], 3 layers, L2 norm of each layer's Params
layer  params
    0       2
    1       2
    2       2

ensemble: Vmap[Linear], 2 layers, L2 norm of each layer's Params
layer  params
    0       2
    1       2"""
  )
  assert [n.class_name for n in table.layer_norms] == ["RematScan[Body]", "Vmap[Linear]"]


def test_repeated_calls_and_shared_modules():
  class Twice(sr.Module):
    def __init__(self, rngs):
      self.a = sr.nn.Linear(2, 2, rngs=rngs)
      self.b = self.a  # shared: one row, its parameters counted once

    def __call__(self, x):
      return self.b(self.a(x[:3]))

  table = sr.summary(Twice(sr.Rngs(0)), jnp.ones((5, 2)))
  assert [r.path_text for r in table.rows] == ["(root)", "a"]
  assert table.total_params == 6
  assert row(table, "a").outputs_text() == "float32[3,2] ×2"


def test_without_inputs_counts_only():
  table = sr.summary(Net(sr.Rngs(0)))
  assert table.total_params == param_count(Net(sr.Rngs(0)))
  assert all(r.outputs == () for r in table.rows)


def test_nothing_is_computed_and_nothing_changes():
  model = Net(sr.Rngs(0))
  before = snapshot(model)
  calls = Block.__call__
  sr.summary(model, jnp.ones((4, 3)))
  assert_unchanged(model, before)  # BatchNorm statistics and RNG counts included
  assert Block.__call__ is calls and "__call__" not in vars(sr.Module)


def test_one_summary_walks_the_model_once(monkeypatch):
  # The core's graph walkers, wherever a file of the package bound them, count each walk
  # that starts at the model or one of its modules (a walker called by another walker
  # is the same walk). Walks of the traced copy (remat_scan splitting its stack) are
  # the model's own code running, not the summary's, and start elsewhere.
  from statefulremat.core import _graph, _module

  model = Net(sr.Rngs(0), lengths=(2, 3))
  x = jnp.ones((4, 3))
  grads = jax.tree.map(jnp.ones_like, sr.state(model, sr.Param))  # as sr.grad gives
  ours = {id(m) for _, m in model.iter_modules()}
  walkers = [_graph.flatten, _module.iter_graph, _module.arrivals]
  codes = {w.__code__ for w in walkers}
  walks = []

  def counting(walker):
    def counted(roots, *args, **kwargs):
      starts = roots if isinstance(roots, (list, tuple)) else [roots]
      if sys._getframe(1).f_code not in codes and any(id(r) in ours for r in starts):
        walks.append((walker.__name__, starts))
      return walker(roots, *args, **kwargs)

    return counted

  for name, module in list(sys.modules.items()):
    if name.startswith("statefulremat") and module is not None:
      for attr, value in list(vars(module).items()):
        if any(value is w for w in walkers):
          monkeypatch.setattr(module, attr, counting(value))
  table = sr.summary(model, x, grads=grads)
  monkeypatch.undo()
  assert len(walks) == 1 and list(walks[0][1]) == [model], walks
  # ...and the one walk gave every part what it shows.
  assert row(table, "blocks.linear").outputs == ("float32[4,8]",)
  assert row(table, "blocks").params_text() == "528 (6 × 88)"
  assert table.layer_norms[0].grads.shape == (6,)


# -- misuse --------------------------------------------------------------------------


def test_a_call_that_fails_names_the_summary_and_restores_everything():
  model = Net(sr.Rngs(0))
  before = snapshot(model)
  linear_call = sr.nn.Linear.__call__
  with pytest.raises(Exception) as info:
    sr.summary(model, jnp.ones((4, 5)))  # embed takes 3 features
  assert "while sr.summary traced Net.__call__(float32[4,5])" in "\n".join(info.value.__notes__)
  assert sr.nn.Linear.__call__ is linear_call
  assert_unchanged(model, before)


def test_keyboard_interrupt_inside_the_call_restores_the_classes():
  class Stop(sr.Module):
    def __init__(self):
      self.inner = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

    def __call__(self, x):
      raise KeyboardInterrupt

  calls = Stop.__call__
  with pytest.raises(KeyboardInterrupt):
    sr.summary(Stop(), jnp.ones((1, 2)))
  assert Stop.__call__ is calls


def test_not_a_module():
  model = Net(sr.Rngs(0))
  with pytest.raises(
    TypeError,
    match=r"sr.summary takes a module, got State.*"
    r"`sr.summary\(model, x\)`",
  ):
    sr.summary(sr.state(model))
  with pytest.raises(TypeError, match="got type"):
    sr.summary(Net, jnp.ones((4, 3)))


def test_a_method_the_class_lacks():
  with pytest.raises(
    AttributeError,
    match=r"method='encode'\): Net has no method "
    r"'encode'. Fix: name a method",
  ):
    sr.summary(Net(sr.Rngs(0)), jnp.ones((4, 3)), method="encode")


# -- display -------------------------------------------------------------------------


class Tiny(sr.Module):
  def __init__(self, *, rngs=None):
    self.w = sr.Param(jnp.arange(6.0).reshape(2, 3))


def test_display_outside_a_notebook_prints_the_compact_text(capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "IPython", None)  # as if IPython were absent
  sr.display(Tiny())
  assert capsys.readouterr().out == repr(Tiny()) + "\n"


def test_display_in_a_notebook_draws_only_stacked_arrays_as_figures(monkeypatch):
  shown = []
  fake = types.SimpleNamespace(get_ipython=lambda: object())
  monkeypatch.setitem(sys.modules, "IPython", fake)
  monkeypatch.setattr(
    treescope, "display", lambda obj, autovisualize: shown.append((obj, autovisualize))
  )

  class Holder(sr.Module):
    def __init__(self):
      self.plain = Tiny()
      self.stack = sr.vmap(Tiny, axis_size=4)()

  holder = Holder()
  sr.display(holder)
  ((obj, visualizer),) = shown
  assert obj is holder
  with treescope.active_autovisualizer.set_scoped(visualizer):
    html = treescope.render_to_html(holder, compressed=False)
  # The stacked array's figure shows one layer at a time, a slider over the 4 layers;
  # no figure for the plain (2, 3) array.
  assert (
    html.count(
      '"slicedAxisSpecs": [{"name": "a0", "label": "layers (axis 0)", "start": 0, "end": 4}]'
    )
    == 1
  )
  assert html.count("(axis 0)") == 1

  shown.clear()
  sr.display(holder, arrays="none")
  assert shown[0][1] is False


def test_a_big_layer_is_cut_within_the_layer_never_across_layers():
  from statefulremat.display._figures import layer_slider_figure
  from statefulremat.display._treescope_arrays import LayeredArray

  # 12 layers of 768 x 3072: every layer stays reachable by the slider; each layer's
  # axes keep their first and last entries, and say so.
  array = LayeredArray(jnp.zeros((12, 768, 3072)), 0, "layers", ("embed", "mlp"))
  html = treescope.render_to_html(layer_slider_figure(array), compressed=False)
  html = html.replace("&quot;", '"')
  assert '"label": "layers (axis 0)", "start": 0, "end": 12}' in html
  for axis in ("embed: 768", "mlp: 3072"):
    assert f'"label": "{axis}, the first and last 24 shown", "start": 0, "end": 48}}' in html
  # Key arrays (stacked RNG streams) and tracers are left to the text.
  keys = LayeredArray(jax.random.split(jax.random.key(0), 3), 0, "layers")
  assert layer_slider_figure(keys) is None


def test_display_all_arrays_slides_the_stacked_ones():
  from statefulremat.display._figures import autovisualizer

  class Holder(sr.Module):
    def __init__(self):
      self.plain = Tiny()
      self.stack = sr.vmap(Tiny, axis_size=4)()

  with treescope.active_autovisualizer.set_scoped(autovisualizer("all")):
    html = treescope.render_to_html(Holder(), compressed=False)
  assert html.count('"label": "layers (axis 0)", "start": 0, "end": 4}') == 1
  assert html.count('"label": "axis 0: 2"') == 1  # the plain array, whole


def test_display_with_an_unknown_arrays_option():
  with pytest.raises(
    ValueError,
    match=r"arrays='some'\): say which arrays .* 'stacked', "
    r"'all', 'none'",
  ):
    sr.display(Tiny(), arrays="some")


def test_a_call_that_returns_a_module_shows_its_class_not_its_leaves():
  # Modules are pytrees: the output column must not expand one into its arrays.
  class Inner(sr.Module):
    def __init__(self):
      self.w = sr.Param(jnp.ones(2))

    def __call__(self, x):
      return self

  class Outer(sr.Module):
    def __init__(self):
      self.inner = Inner()

    def __call__(self, x):
      self.inner(x)
      return x

  rows = {row.path: row for row in sr.summary(Outer(), jnp.ones(2)).rows}
  assert rows[("inner",)].outputs == ("Inner",)
  assert rows[()].outputs == ("float32[2]",)


# -- paths of shared modules, norms ----------------------------------------------------


def test_a_shared_rngs_is_listed_at_its_path_in_the_state():
  class Shared(sr.Module):
    def __init__(self, rngs):
      # Definition order meets the Rngs first in mlp.dropout; sr.state's sorted walk
      # in drop.
      self.mlp = sr.nn.MLP(4, 8, dropout_rate=0.1, rngs=rngs)
      self.drop = sr.nn.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.mlp(x))

  model = Shared(sr.Rngs(0))
  state_paths = {p[:-1] for p in sr.state(model, "rngs").flat()}
  assert state_paths == {("drop", "rngs", "default")}
  table = sr.summary(model, jnp.ones((2, 4)))
  paths = [r.path_text for r in table.rows]
  assert paths == [
    "(root)",
    "mlp",
    "mlp.fc1",
    "mlp.fc2",
    "mlp.dropout",
    "drop",
    "drop.rngs",
    "drop.rngs.default",
  ]
  # Both Dropouts draw from it: its calls land on its one row.
  assert row(table, "drop.rngs.default").outputs_text() == "key<fry>[] ×3"
  assert row(table, "mlp.dropout").bytes == {"rngs": 12}  # what it holds, shared or not


def per_layer_norm(*arrays):
  return np.sqrt(
    sum(np.sum(np.square(np.asarray(a)), axis=tuple(range(1, np.ndim(a)))) for a in arrays)
  )


def test_per_layer_norms_of_a_stack():
  model = Net(sr.Rngs(0))
  table = sr.summary(model)
  (stack,) = table.layer_norms
  b = model.blocks
  expected = per_layer_norm(
    b.linear.kernel.value, b.linear.bias.value, b.norm.scale.value, b.norm.bias.value
  )  # Params only
  assert stack.path == ("blocks",) and stack.grads is None
  np.testing.assert_allclose(stack.params, expected, rtol=1e-6)
  lines = str(table).split("\n")
  start = lines.index("blocks: RematScan[Block], 20 layers, L2 norm of each layer's Params")
  assert lines[start + 1] == "layer  params"
  assert lines[start + 2] == f"    0  {expected[0]:6.4g}"
  assert len(lines) == start + 2 + 20
  # Without grads, the main table has no norm columns.
  assert "norm" not in lines[0]
  norms = table.norms()
  assert norms["params/norm/blocks.3.linear.kernel"] == pytest.approx(
    np.linalg.norm(b.linear.kernel.value[3]), rel=1e-6
  )
  assert norms["params/norm/embed.kernel"] == pytest.approx(
    np.linalg.norm(model.embed.kernel.value), rel=1e-6
  )
  everything = jax.tree.leaves(sr.state(model, sr.Param))
  assert norms["params/norm/total"] == pytest.approx(
    np.sqrt(sum(np.sum(np.square(x)) for x in everything)), rel=1e-6
  )
  assert "params/norm/blocks.20.linear.kernel" not in norms
  assert len(norms) == 4 + 4 * 20 + 1  # embed, head; 4 per layer; the total


def test_gradient_norms_given_grads():
  model = Net(sr.Rngs(0), lengths=(2, 3))
  x = jax.random.normal(jax.random.key(1), (16, 3))
  model.eval()  # running statistics: gradients of a sane size
  grads = sr.grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
  table = sr.summary(model, x, grads=grads)
  (stack,) = table.layer_norms
  g = grads["blocks"]
  expected = per_layer_norm(
    g["linear"]["kernel"], g["linear"]["bias"], g["norm"]["scale"], g["norm"]["bias"]
  )
  np.testing.assert_allclose(stack.grads, expected, rtol=1e-5)
  assert row(table, "head").grad_norm == pytest.approx(
    np.sqrt(np.sum(np.square(grads["head"]["kernel"])) + np.sum(np.square(grads["head"]["bias"]))),
    rel=1e-5,
  )
  assert row(table, "drop").grad_norm is None  # no Params: "-"
  lines = str(table).split("\n")
  assert lines[0].split() == [
    "path",
    "class",
    "params",
    "params",
    "bytes",
    "batch_stats",
    "bytes",
    "rngs",
    "bytes",
    "params",
    "norm",
    "grads",
    "norm",
    "output",
  ]
  start = lines.index(
    "blocks: RematScan[Block], 6 layers, L2 norm of each layer's Params and gradients"
  )
  assert lines[start + 1].split() == ["layer", "params", "grads"]
  assert lines[start + 2].split() == ["0", f"{stack.params[0]:.4g}", f"{expected[0]:.4g}"]
  assert len(lines) == start + 2 + 6
  norms = table.norms()
  assert norms["grad/norm/blocks.5.norm.scale"] == pytest.approx(
    np.linalg.norm(g["norm"]["scale"][5]), rel=1e-5
  )
  assert norms["grad/norm/total"] == pytest.approx(
    np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grads))), rel=1e-5
  )


def test_long_stacks_list_the_ends_and_the_largest_layers():
  from statefulremat.display._summary import LayerNorms

  stack = LayerNorms(
    ("blocks",),
    "Block",
    np.where(np.arange(40) == 11, 9.0, 1.0),
    np.where(np.arange(40) == 20, 1e6, 1.0),
  )
  lines = stack.lines()
  layers = [line.split()[0] for line in lines[2:]]
  # 0-7, the largest params norm (11), the largest gradient (20), 32-39; `…` between.
  assert layers == [
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "…",
    "11",
    "…",
    "20",
    "…",
    "32",
    "33",
    "34",
    "35",
    "36",
    "37",
    "38",
    "39",
  ]
  assert lines[2 + layers.index("11")].split() == ["11", "9", "1"]
  assert lines[2 + layers.index("20")].split() == ["20", "1", "1e+06"]


def test_no_norms_for_an_abstract_model():
  abstract = sr.eval_shape(lambda: Net(sr.Rngs(0)))
  table = sr.summary(abstract)
  assert table.layer_norms == [] and table.norms() == {}
  assert all(r.param_norm is None for r in table.rows)


def test_grads_that_do_not_fit_the_model():
  model = Net(sr.Rngs(0))
  grads = sr.grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones((2, 3)))
  with pytest.raises(
    TypeError,
    match=r"grads=...\) takes the State sr.grad returns, got "
    r"dict",
  ):
    sr.summary(model, grads={"head": {}})
  other = sr.grad(lambda m: jnp.sum(m.kernel.value))(sr.nn.Linear(3, 8, rngs=sr.Rngs(0)))
  with pytest.raises(ValueError, match=r"`bias` is not a Param of this model"):
    sr.summary(model, grads=other)
  small = Net(sr.Rngs(0), lengths=(2, 2))
  with pytest.raises(
    ValueError,
    match=r"gradient at `blocks.linear.bias` has shape "
    r"\(20, 8\), the Param \(4, 8\)",
  ):
    sr.summary(small, grads=grads)


def test_a_stack_in_a_stack_counts_outer_times_inner_layers():
  class Pair(sr.Module):
    def __init__(self, *, rngs):
      self.ens = sr.vmap(sr.nn.Linear, axis_size=2, in_axes=None)(2, 1, rngs=rngs)

    def __call__(self, x):
      return x, None

  stack = sr.scan(Pair, length=3, variable_axes={True: 0})(rngs=sr.Rngs(0))
  rows = {row.path: row for row in sr.summary(stack).rows}
  # 3 outer layers x 2 ensemble members, each a Linear(2, 1) of 3 parameters.
  for path in [(), ("ens",)]:
    assert (rows[path].params, rows[path].layers, rows[path].params_per_layer) == (18, 6, 3)
    assert rows[path].params_text() == "18 (6 × 3)"
