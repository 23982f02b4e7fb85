"""treescope rendering: exact text of small zero-filled models, stacked axis names,
shared variables drawn once, State, and the axis labels in the HTML array figure."""

import jax.numpy as jnp
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
  assert text(Tiny(1)) == """\
Tiny(
  w=Param(
    value=<jax.Array([[0., 0.]], dtype=float32)>,
    sharding=('embed', None),
  ),
  count=BatchStat(value=<jax.Array(1., dtype=float32)>),
  label='tiny',
)"""


def test_stacked_module_names_its_layer_axis():
  stack = sr.vmap(Tiny, axis_size=3)()
  assert text(stack) == """\
VmapTiny(
  count=BatchStat(
    value=<jax.Array float32(| layers:3) ≈1.0 ±0.0 [≥1.0, ≤1.0] nonzero:3>,
  ),
  label='tiny',
  w=Param(
    value=<jax.Array float32(2 | layers:3, embed:2) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:12>,
    sharding=('embed', None),
  ),
)"""


def test_stacked_module_uses_the_partition_name():
  stack = sr.scan(Tiny, length=4, variable_axes={sr.Param: 0},
                  metadata_params={"partition_name": "depth"})()
  rendered = text(stack)
  assert "float32(| depth:4, embed:2, 2)" not in rendered  # positional axes come first
  assert "value=<jax.Array float32(2 | depth:4, embed:2)" in rendered
  assert "sharding=('depth', 'embed', None)" in rendered
  # The BatchStat is broadcast (not stacked): no layer axis.
  assert "count=BatchStat(value=<jax.Array(1., dtype=float32)>)" in rendered


def test_shared_variables_and_modules_are_drawn_once():
  class Pair(sr.Module):
    def __init__(self):
      self.first = Tiny(1)
      self.tied = self.first.w
      self.again = [self.first]

  assert text(Pair()) == """\
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


def test_state():
  assert text(sr.state(Tiny(1))) == """\
State({
  'count': BatchStat(value=<jax.Array(1., dtype=float32)>),
  'w': Param(
    value=<jax.Array([[0., 0.]], dtype=float32)>,
    sharding=('embed', None),
  ),
})"""


def test_nested_state_follows_indexing():
  class Outer(sr.Module):
    def __init__(self):
      self.inner = Tiny(1)

  rendered = text(sr.state(Outer(), sr.BatchStat))
  assert rendered == """\
State({
  'inner': {'count': BatchStat(value=<jax.Array(1., dtype=float32)>)},
})"""


def test_html_array_figure_labels_the_layer_axis():
  stack = sr.vmap(Tiny, axis_size=3)()
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(stack, compressed=False)
  assert '"label": "layers (axis 0): 3"' in html
  assert "float32(2 | layers:3, embed:2)" in html


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
  assert text(sr.graphdef(Pair())) == """\
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
  assert seen == ["""\
Param(
  value=JitTracer(float32[1,2]),
  sharding=('embed', None),
)"""]


def test_parts_of_a_stack_drawn_alone_still_name_the_layer_axis():
  class Holder(sr.Module):
    def __init__(self, *, rngs=None):
      self.inner = Tiny(1)

  stack = sr.vmap(Holder, axis_size=3)()
  # inner.w is (3, 1, 2): the layer axis, then `embed` (1), then an unnamed 2.
  assert "float32(2 | layers:3, embed:1)" in text(stack.inner)
  assert "float32(2 | layers:3, embed:1)" in text(stack.inner.w)
  assert "layers:" not in text(Tiny(1).w)  # an ordinary Variable: no layer axis
