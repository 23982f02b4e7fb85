"""treescope rendering: exact text of small zero-filled models, stacked axis names,
shared variables drawn once, State, and the axis labels in the HTML array figure; a repr
leaves out settings at their constructor defaults, the foldable view folds them (and
RNG streams) and opens the modules."""

import functools
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import treescope

import statefulremat as sr


class Tiny(sr.Module):
  def __init__(self, n=2, *, rngs=None):
    self.w = sr.Param(jnp.zeros((n, 2)), sharding=("embed", None))
    self.count = sr.BatchStat(jnp.ones(()))
    self.label = "tiny"


def text(obj) -> str:
  return treescope.render_to_text(obj)


def test_plain_module():
  assert (
    text(Tiny(1))
    == """\
Tiny(
  w=Param(
    value=<jax.Array([[0., 0.]], dtype=float32)>,
    sharding=('embed', None),
  ),
  count=BatchStat(value=<jax.Array(1., dtype=float32)>),
  label='tiny',
)"""
  )


def test_stacked_module_names_its_layer_axis():
  stack = sr.vmap(Tiny, axis_size=3)()
  assert (
    text(stack)
    == """\
Vmap[Tiny] × 3(
  w=Param(
    value=<jax.Array float32(layers:3, embed:2, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:12>,
    sharding=('embed', None),
  ),
  count=BatchStat(
    value=<jax.Array float32(layers:3) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:3>,
  ),
  label='tiny',
)"""
  )


def test_stacked_module_uses_the_partition_name():
  stack = sr.scan(
    Tiny, length=4, variable_axes={sr.Param: 0}, metadata_params={"partition_name": "depth"}
  )()
  rendered = text(stack)
  assert "value=<jax.Array float32(depth:4, embed:2, 2)" in rendered  # in .shape order
  assert "sharding=('depth', 'embed', None)" in rendered
  # The BatchStat is broadcast (not stacked): no layer axis.
  assert "count=BatchStat(value=<jax.Array(1., dtype=float32)>)" in rendered


def test_shared_variables_and_modules_are_drawn_once():
  class Pair(sr.Module):
    def __init__(self):
      self.first = Tiny(1)
      self.tied = self.first.w
      self.again = [self.first]

  assert (
    text(Pair())
    == """\
Pair(
  first=Tiny(
    w=Param(
      value=<jax.Array([[0., 0.]], dtype=float32)>,
      sharding=('embed', None),
    ),  # shared: also at tied
    count=BatchStat(value=<jax.Array(1., dtype=float32)>),
    label='tiny',
  ),  # shared: also at again[0]
  tied=Param(<shared: drawn at first.w>),
  again=ModuleList([Tiny(<shared: drawn at first>)]),
)"""
  )


def test_state():
  assert (
    text(sr.state(Tiny(1)))
    == """\
State({
  'count': BatchStat(value=<jax.Array(1., dtype=float32)>),
  'w': Param(
    value=<jax.Array([[0., 0.]], dtype=float32)>,
    sharding=('embed', None),
  ),
})"""
  )


def test_nested_state_follows_indexing():
  class Outer(sr.Module):
    def __init__(self):
      self.inner = Tiny(1)

  rendered = text(sr.state(Outer(), sr.BatchStat))
  assert (
    rendered
    == """\
State({
  'inner': {'count': BatchStat(value=<jax.Array(1., dtype=float32)>)},
})"""
  )


def test_html_array_figure_labels_the_layer_axis():
  stack = sr.vmap(Tiny, axis_size=3)()
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(stack, compressed=False)
  assert '"label": "layers (axis 0): 3"' in html
  assert "float32(layers:3, embed:2, 2)" in html


def test_rendering_leaves_the_model_unchanged():
  stack = sr.vmap(Tiny, axis_size=3)()
  before = sr.graphdef(stack), sr.state(stack)
  text(stack)
  after = sr.graphdef(stack), sr.state(stack)
  assert before[0] == after[0]
  assert before[1].flat().keys() == after[1].flat().keys()


def test_graphdef_draws_the_structure_without_values():
  class Pair(sr.Module):
    def __init__(self):
      self.first = Tiny(1)
      self.tied = self.first.w
      self.heads = {"a": Tiny(1)}

  # The GraphDef walks attributes in sorted order, so `first` is reached second.
  assert (
    text(sr.graphdef(Pair()))
    == """\
GraphDef(
  Pair(
    first=Tiny(
      count=BatchStat(),
      label='tiny',
      w=Param(sharding=('embed', None)),
    ),
    heads=ModuleDict({
      'a': Tiny(
        count=BatchStat(),
        label='tiny',
        w=Param(sharding=('embed', None)),
      ),
    }),
    tied=Param(<shared: drawn at first.w>),
  ),
)"""
  )


def test_repr_is_the_compact_text():
  model = sr.nn.Linear(2, 3, use_bias=False, rngs=sr.Rngs(0))
  # Multi-line arrays fold to treescope's one-line summary; one-line arrays stay.
  assert repr(model).startswith("""\
Linear(
  kernel=Param(
    value=<jax.Array float32(2, 3) ≈""")
  assert repr(Tiny(1)) == text(Tiny(1))
  for obj in (model, sr.state(model), sr.graphdef(model), model.kernel, sr.Rngs(0)):
    assert " at 0x" not in repr(obj)


def test_repr_inside_a_transform_shows_the_tracer():
  seen = []

  @sr.jit
  def peek(model):
    seen.append(repr(model.w))

  peek(Tiny(1))
  assert seen == [
    """\
Param(
  value=JitTracer(float32[1,2]),
  sharding=('embed', None),
)"""
  ]


def test_parts_of_a_stack_drawn_alone_still_name_the_layer_axis():
  class Holder(sr.Module):
    def __init__(self, *, rngs=None):
      self.inner = Tiny(1)

  stack = sr.vmap(Holder, axis_size=3)()
  # inner.w is (3, 1, 2): the layer axis, then `embed` (1), then an unnamed 2.
  assert "float32(layers:3, embed:1, 2)" in text(stack.inner)
  assert "float32(layers:3, embed:1, 2)" in text(stack.inner.w)
  assert "layers:" not in text(Tiny(1).w)  # an ordinary Variable: no layer axis


# -- settings at their defaults, what the foldable view opens ------------------------


def zero_linear(**kwargs):
  return sr.nn.Linear(2, 3, kernel_init=jax.nn.initializers.zeros, rngs=sr.Rngs(0), **kwargs)


def test_repr_leaves_out_settings_at_their_defaults():
  # use_bias, dtype, param_dtype, precision, dot_general, promote_dtype and
  # preferred_element_type are all at their defaults: only what differs is shown.
  assert (
    repr(zero_linear())
    == """\
Linear(
  kernel=Param(
    value=<jax.Array float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6>,
  ),
  bias=Param(value=<jax.Array([0., 0., 0.], dtype=float32)>),
  in_features=2,
  out_features=3,
)"""
  )
  # Settings that differ are shown; `bias=None` is an empty slot, left out.
  assert (
    repr(zero_linear(use_bias=False, param_dtype=jnp.bfloat16, precision="highest"))
    == """\
Linear(
  kernel=Param(
    value=<jax.Array bfloat16(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6>,
  ),
  in_features=2,
  out_features=3,
  use_bias=False,
  param_dtype=jax.numpy.bfloat16,
  precision='highest',
)"""
  )


def test_the_foldable_view_keeps_the_defaults_folded_on_one_line():
  assert (
    text(zero_linear())
    == """\
Linear(
  kernel=Param(
    value=# jax.Array float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6
      Array([[0., 0., 0.],
             [0., 0., 0.]], dtype=float32)
    ,
  ),
  bias=Param(value=<jax.Array([0., 0., 0.], dtype=float32)>),
  in_features=2,
  out_features=3,
  # 7 at defaults: use_bias, dtype, param_dtype, precision, dot_general, …
)"""
  )
  # All of them are in the page, one click away.
  html = treescope.render_to_html(zero_linear(), compressed=False)
  for name in (
    "use_bias",
    "dtype",
    "param_dtype",
    "precision",
    "dot_general",
    "promote_dtype",
    "preferred_element_type",
  ):
    assert f"{name}=" in html, name


def test_rng_streams_start_folded_in_the_foldable_view_and_whole_in_the_repr():
  drop = sr.nn.Dropout(0.5, rngs=sr.Rngs(0))
  assert (
    text(drop)
    == """\
Dropout(
  rate=0.5,
  rngs=Rngs(default=…),
  # 3 at defaults: broadcast_dims, deterministic, rng_collection
)"""
  )
  assert (
    repr(drop)
    == """\
Dropout(
  rate=0.5,
  rngs=Rngs(
    default=RngStream(
      key=RngKey(value=<jax.Array key<fry>()>, tag='default'),
      count=RngCount(value=<jax.Array(0, dtype=uint32)>, tag='default'),
      tag='default',
    ),
  ),
)"""
  )


def test_the_demo_page_opens_on_the_layers_and_folds_the_rng_streams():
  demo = pathlib.Path(__file__).resolve().parents[1] / "examples" / "demo.py"
  ResidualMLP = runpy.run_path(str(demo))["ResidualMLP"]  # its names; main() runs as __main__ only
  from statefulremat.display._figures import stacked_arrays

  model = ResidualMLP(100, 8, rngs=sr.Rngs(params=0, dropout=1))
  with treescope.active_autovisualizer.set_scoped(stacked_arrays):
    page = text(model.blocks)  # the layout the HTML page opens with
  assert page.startswith("""\
RematScan[Block] × 100(
  norm=BatchNorm(
    mean=BatchStat(value=<float32(layers:100, 8) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:800>),
    var=BatchStat(value=<float32(layers:100, 8) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:800>),
    scale=Param(value=<float32(layers:100, 8) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:800>),
    bias=Param(value=<float32(layers:100, 8) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:800>),
    num_features=8,
    momentum=0.9,
    # 11 at defaults: use_running_average, axis, epsilon, dtype, param_dtype, …
  ),
  fc1=Linear(
    kernel=Param(value=<float32(layers:100, 8, 8) ≈""")
  for line in (  # in the order Block.__init__ sets them, as repr(block) shows
    "  drop=Dropout(\n    rate=0.1,\n    rngs=Rngs(params=…, dropout=…),\n",
    "    # 3 at defaults: broadcast_dims, deterministic, rng_collection\n  ),\n  fc2=Linear(",
  ):
    assert line in page


def test_which_settings_are_at_their_defaults():
  from statefulremat.display._repr import settings_at_defaults

  def double(x):
    return 2 * x

  class Layer(sr.Module):
    def __init__(
      self,
      n,
      *,
      scale=jnp.ones(2),
      fn=jax.nn.relu,
      dtype=jnp.float32,
      axis=-1,
      names=(),
      gate=functools.partial(double),
      flag=True,
    ):
      self.n, self.scale, self.fn, self.dtype = n, scale, fn, dtype
      self.axis, self.names, self.gate, self.flag = (axis,), names, gate, flag
      self.cache = None  # an empty slot, not a constructor argument
      self.w = sr.Param(jnp.zeros(2))

  assert settings_at_defaults(Layer(3)) == [
    "scale",
    "fn",
    "dtype",
    "axis",
    "names",
    "gate",
    "flag",
    "cache",
  ]
  changed = Layer(
    3,
    scale=jnp.ones(3),
    fn=jax.nn.gelu,
    dtype="bfloat16",
    axis=0,
    names=("a",),
    gate=functools.partial(double, 1),
    flag=1,
  )
  assert settings_at_defaults(changed) == ["cache"]  # 1 is not True
  assert settings_at_defaults(Layer(3, dtype=np.dtype("float32"))) == [
    "scale",
    "fn",
    "dtype",
    "axis",
    "names",
    "gate",
    "flag",
    "cache",
  ]
  # A stack's class takes *args, **kwargs: its layer class's defaults apply.
  stack = sr.vmap(sr.nn.Dropout, axis_size=2)(0.5)
  assert settings_at_defaults(stack) == [
    "broadcast_dims",
    "deterministic",
    "rng_collection",
    "rngs",
  ]


def test_settings_inside_a_trace_compare_without_raising():
  from statefulremat.display._repr import same_setting

  seen = []

  @jax.jit
  def f(x):
    seen.append((same_setting(x, jnp.zeros(2)), same_setting((x,), ())))
    return x

  f(jnp.zeros(2))
  assert seen == [(False, False)]


# -- the view of a stack: shapes in .shape order, statistics, figures, the root's name ---


def zero_scan_linear():
  Stack = sr.scan(
    sr.nn.Linear,
    length=4,
    variable_axes={sr.Param: 0},
    split_rngs={"params": True},
    metadata_params={"partition_name": "layers"},
  )
  return Stack(
    2,
    3,
    kernel_init=jax.nn.initializers.zeros,
    kernel_metadata={"sharding": ("embed", "mlp")},
    rngs=sr.Rngs(0),
  )


def test_a_stack_reads_in_shape_order_with_its_axes_named_in_place():
  from statefulremat.display._display import page

  stack = zero_scan_linear()
  assert stack.kernel.shape == (4, 2, 3)
  assert (
    repr(stack)
    == """\
Scan[Linear] × 4(
  kernel=Param(
    value=<jax.Array float32(layers:4, embed:2, mlp:3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:24>,
    sharding=('layers', 'embed', 'mlp'),
  ),
  bias=Param(
    value=<jax.Array float32(layers:4, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:12>,
  ),
  in_features=2,
  out_features=3,
)"""
  )
  # The same notation in the foldable view, and in the HTML page's summaries.
  assert "float32(layers:4, embed:2, mlp:3)" in text(stack)
  assert "float32(layers:4, embed:2, mlp:3)" in page(stack)


def test_a_layer_axis_not_first_is_named_where_it_is():
  stack = sr.scan(Tiny, length=2, variable_axes={sr.Param: 1})()
  assert stack.w.shape == (2, 2, 2)
  assert (
    repr(stack.w)
    == """\
Param(
  value=<jax.Array float32(embed:2, layers:2, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:8>,
  sharding=('embed', None),
)"""
  )


def test_a_stack_of_stacks_names_both_layer_axes_and_both_classes():
  nested = sr.vmap(sr.scan(Tiny, length=2, variable_axes={sr.Param: 0}), axis_size=3)()
  assert (
    repr(nested)
    == """\
Vmap[Scan[Tiny] × 2] × 3(
  w=Param(
    value=<jax.Array float32(layers:3, layers:2, embed:2, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:24>,
    sharding=('embed', None),
  ),
  count=BatchStat(
    value=<jax.Array float32(layers:3) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:3>,
  ),
  label='tiny',
)"""
  )


def test_a_pattern_stack_names_its_classes_and_each_position_its_layers():
  stack = sr.vmap((Tiny, Tiny), axis_size=3)()
  assert (
    repr(stack)
    == """\
Vmap[Tiny, Tiny](  # 3 layers: (Tiny, Tiny) × 1 + (Tiny)
  pattern=(
    Vmap[Tiny] × 2(  # position 0 of 2: Tiny, 2 layers (0, 2)
      w=Param(
        value=<jax.Array float32(layers:2, embed:2, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:8>,
        sharding=('embed', None),
      ),
      count=BatchStat(
        value=<jax.Array float32(layers:2) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:2>,
      ),
      label='tiny',
    ),
    Vmap[Tiny] × 1(  # position 1 of 2: Tiny, 1 layer (1)
      w=Param(
        value=<jax.Array float32(layers:1, embed:2, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:4>,
        sharding=('embed', None),
      ),
      count=BatchStat(
        value=<jax.Array float32(layers:1) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:1>,
      ),
      label='tiny',
    ),
  ),
)"""
  )


def test_the_root_names_the_users_class_and_the_layer_count():
  assert repr(sr.remat_scan(Tiny, lengths=(2, 2))()).startswith("RematScan[Tiny] × 4(\n")
  assert text(sr.vmap(Tiny, axis_size=3)()).startswith("Vmap[Tiny] × 3(\n")

  class Pair(sr.Module):
    def __init__(self):
      self.a = sr.vmap(Tiny, axis_size=2)()
      self.b = self.a

  lines = repr(Pair()).splitlines()
  assert lines[1] == "  a=Vmap[Tiny] × 2("
  assert lines[-2] == "  b=Vmap[Tiny](<shared: drawn at a>),"
  # Roundtrip mode still names the class a program can import.
  stack = sr.vmap(Tiny, axis_size=3)()
  assert "VmapTiny(" in treescope.render_to_text(stack, roundtrip_mode=True)


def test_an_unstacked_array_is_drawn_as_before():
  assert (
    repr(sr.Param(jnp.zeros((8, 8))))
    == """\
Param(
  value=<jax.Array float32(8, 8) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:64>,
)"""
  )
  assert repr(sr.Param(jnp.zeros(2))) == "Param(value=<jax.Array([0., 0.], dtype=float32)>)"


def test_every_array_gets_its_statistics_the_big_ones_too():
  # 160,000 entries: past treescope's 100,000, where it said "too large to summarize".
  big = sr.Param(jnp.zeros((400, 400)))
  assert (
    repr(big)
    == """\
Param(
  value=<jax.Array float32(400, 400) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:160_000>,
)"""
  )
  assert text(big).startswith("""\
Param(
  value=# jax.Array float32(400, 400) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:160_000
""")
  stacked = sr.vmap(Tiny, axis_size=3)(40_000).w  # (3, 40000, 2): 240,000 entries
  assert "float32(layers:3, embed:40000, 2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:240_000>" in repr(stacked)


def test_statistics_are_computed_once_per_array(monkeypatch):
  from statefulremat.display import _array_stats

  calls = []
  summarize = _array_stats._summarize
  monkeypatch.setattr(_array_stats, "_summarize", lambda a: calls.append(1) or summarize(a))
  stack = sr.vmap(Tiny, axis_size=3)(300)
  for _ in range(3):
    repr(stack)
    text(stack)
  assert len(calls) == 2  # w and count, once each


def html_of(obj, visualizer=None) -> str:
  from statefulremat.display._figures import stacked_arrays

  with treescope.active_autovisualizer.set_scoped(visualizer or stacked_arrays):
    html = treescope.render_to_html(obj, compressed=False)
  return html.replace("&quot;", '"')


def test_a_stacked_bias_or_batchstat_is_one_layers_by_features_image():
  stack = zero_scan_linear()
  html = html_of(stack.bias)
  # The whole (4, 3) array in one figure, a column per layer; no slider.
  assert (
    '"xAxisSpecs": [{"name": "a0", "label": "layers (axis 0): 4", "start": 0, "end": 4}], '
    '"yAxisSpecs": [{"name": "a1", "label": "axis 1: 3", "start": 0, "end": 3}], '
    '"slicedAxisSpecs": []'
  ) in html
  # A per-layer scalar: one strip of layers.
  counts = html_of(sr.vmap(Tiny, axis_size=3)().count)
  assert (
    '"xAxisSpecs": [{"name": "a0", "label": "layers (axis 0): 3", "start": 0, "end": 3}], '
    '"yAxisSpecs": [], "slicedAxisSpecs": []'
  ) in counts


def test_a_stacked_kernel_has_a_slider_and_each_layers_norm():
  stack = zero_scan_linear()
  stack.kernel.value = jnp.arange(4.0)[:, None, None] * jnp.ones((4, 2, 3))
  html = html_of(stack.kernel)
  # One layer (embed × mlp, named by its sharding) at a time, the layers on a slider.
  assert (
    '"xAxisSpecs": [{"name": "a2", "label": "mlp (axis 2): 3", "start": 0, "end": 3}], '
    '"yAxisSpecs": [{"name": "a1", "label": "embed (axis 1): 2", "start": 0, "end": 2}], '
    '"slicedAxisSpecs": [{"name": "a0", "label": "layers (axis 0)", "start": 0, "end": 4}]'
  ) in html
  # Beside it each layer's norm, a strip of layers: layer i is i * ones(2, 3), its
  # norm i * sqrt(6).
  assert "L2 norm of each layer: least 0 at layers[0], most 7.348 at layers[3]" in html
  assert (
    '"xAxisSpecs": [{"name": "a0", "label": "layers: 4", "start": 0, "end": 4}], '
    '"yAxisSpecs": [], "slicedAxisSpecs": []'
  ) in html


def test_under_treescopes_array_autovisualizer_a_stack_is_drawn_as_ours():
  # What `treescope.basic_interactive_setup()` turns on in a notebook.
  stack = zero_scan_linear()
  html = html_of(stack, treescope.ArrayAutovisualizer())
  assert '"label": "layers (axis 0): 4"' in html  # the bias, one image
  assert "L2 norm of each layer: least" in html  # the kernel, a slider and norms
  plain = html_of(Tiny(), treescope.ArrayAutovisualizer())
  assert "L2 norm" not in plain and '"label": "axis 0: 2"' in plain


def test_the_page_draws_as_it_loads_and_carries_its_text(tmp_path):
  from statefulremat.display._display import page

  stack = sr.vmap(Tiny, axis_size=3)()
  path = tmp_path / "stack.html"
  sr.display(stack, path=path)
  html = path.read_text(encoding="utf-8")
  assert html.split("<treescope-container")[0] == page(stack).split("<treescope-container")[0]
  assert html.startswith('<!DOCTYPE html>\n<html><head><meta charset="utf-8">')
  noscript = html[html.index("<noscript>") : html.index("</noscript>")]
  assert noscript == (
    '<noscript><pre class="sr-text">'
    + repr(stack).replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#x27;")
    + "</pre>"
  )
  assert "Vmap[Tiny] × 3</span>(" in html.split("</noscript>")[1]  # the tree, not deflated
