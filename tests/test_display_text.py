"""sr.display and repr draw a module's fields in one order, and treescope's text of our
objects never holds a figure's placeholder (``<Arrayviz rendering>``), whatever draws
arrays as figures (a notebook's autovisualizer, ``sr.display``'s): each figure reads as
its folded line, dtype, shape and statistics."""

import re

import jax.numpy as jnp
import pytest
import treescope

import statefulremat as sr
from statefulremat.display._display import page
from statefulremat.display._figures import stacked_arrays
from statefulremat.display._treescope import compact_text


class Zam(sr.Module):
  """Fields assigned out of alphabetical order."""

  def __init__(self, *, rngs):
    self.z = sr.nn.Linear(2, 3, rngs=rngs)
    self.a = sr.Param(jnp.ones(4))
    self.m = sr.BatchStat(jnp.zeros(5))

  def __call__(self, x):
    return x, None


def fields(text: str) -> list[str]:
  """The top-level field names of a drawn module, in the order drawn."""
  return re.findall(r"^  (\w+)=", text, re.MULTILINE)


def html_fields(html: str) -> list[str]:
  """The top-level field names of a module in treescope's HTML, in the order drawn."""
  tree = html.split("</noscript>")[-1]
  return [name for name in re.findall(r">(\w+)=<", tree) if name in ("z", "a", "m")]


def test_display_and_repr_draw_the_fields_in_the_order_they_were_assigned(capsys):
  model = Zam(rngs=sr.Rngs(0))
  assert fields(repr(model)) == ["z", "a", "m"]
  sr.display(model)  # outside a notebook: the text
  assert fields(capsys.readouterr().out) == ["z", "a", "m"]
  assert fields(treescope.render_to_text(model)) == ["z", "a", "m"]
  assert html_fields(page(model)) == ["z", "a", "m"]
  # A sub-module too: Linear assigns its kernel, then its bias, then its sizes.
  assert re.findall(r"^    (\w+)=", repr(model), re.MULTILINE)[:4] == [
    "kernel",
    "bias",
    "in_features",
    "out_features",
  ]


def test_a_stack_draws_its_fields_in_its_repr_s_order():
  # A stack is rebuilt from its layers' GraphDef, which holds a module's attributes
  # sorted: display and repr both draw them in the order the stack holds them.
  stack = sr.scan(
    Zam, length=3, variable_axes={sr.Param: 0, sr.BatchStat: 0}, split_rngs={"params": True}
  )(rngs=sr.Rngs(0))
  held = list(vars(stack))
  order = [k for k in held if k in ("z", "a", "m")]
  assert fields(repr(stack)) == order
  assert fields(treescope.render_to_text(stack)) == order
  assert html_fields(page(stack)) == order


def test_state_draws_its_paths_in_its_repr_s_order():
  state = sr.state(Zam(rngs=sr.Rngs(0)))
  drawn = re.findall(r"^  '(\w+)':", treescope.render_to_text(state), re.MULTILINE)
  assert drawn == re.findall(r"^  '(\w+)':", repr(state), re.MULTILINE)


def model_with_arrays():
  Stack = sr.scan(
    Zam,
    length=3,
    variable_axes={sr.Param: 0, sr.BatchStat: 0},
    split_rngs={"params": True},
    metadata_params={"partition_name": "layers"},
  )

  class Net(sr.Module):
    def __init__(self, *, rngs):
      self.layer = Zam(rngs=rngs)
      self.blocks = Stack(rngs=rngs)

  return Net(rngs=sr.Rngs(0))


# What a notebook after `treescope.basic_interactive_setup()` draws arrays with, and
# what `sr.display` draws them with.
VISUALIZERS = {"treescope": treescope.ArrayAutovisualizer(), "ours": stacked_arrays}


@pytest.mark.parametrize("visualizer", list(VISUALIZERS))
def test_text_under_an_autovisualizer_has_no_placeholder_but_each_arrays_line(visualizer, capsys):
  model = model_with_arrays()
  with treescope.active_autovisualizer.set_scoped(VISUALIZERS[visualizer]):
    texts = {
      "repr": repr(model),
      "compact": compact_text(model),
      "render_to_text": treescope.render_to_text(model),
      "state": treescope.render_to_text(sr.state(model)),
      "variable": treescope.render_to_text(model.layer.z.kernel),
      "stacked variable": treescope.render_to_text(model.blocks.z.kernel),
    }
    sr.display(model)
    texts["display"] = capsys.readouterr().out
  for name, text in texts.items():
    assert "Arrayviz" not in text and "rendering>" not in text, f"{name}:\n{text}"
  for name in ("repr", "compact", "render_to_text", "state", "display"):
    assert "float32(2, 3)" in texts[name], f"{name}:\n{texts[name]}"  # the kernel
    assert "float32(layers:3, 2, 3)" in texts[name], f"{name}:\n{texts[name]}"  # stacked
  # A figure reads as the line it folds to: dtype, shape, statistics (ours draws only
  # stacked arrays: the other kernel is treescope's text of it).
  if visualizer == "treescope":
    assert re.search(r"<jax\.Array float32\(2, 3\) ≈\S+ ±\S+ \[", texts["variable"])
  assert re.search(r"<float32\(layers:3, 2, 3\) ≈\S+ ±\S+ \[", texts["stacked variable"])


def test_text_is_the_same_with_or_without_an_autovisualizer_in_a_repr():
  model = model_with_arrays()
  plain = repr(model)
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    assert repr(model) == plain


def test_the_html_still_draws_the_figures():
  model = model_with_arrays()
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(model, compressed=False).replace("&quot;", '"')
  assert "L2 norm of each layer" in html  # the stacked kernel: ours
  assert '"label": "axis 0: 2"' in html  # the other kernel (2, 3): treescope's figure
  assert "Arrayviz rendering" not in html
  assert "Arrayviz" not in page(model).split("<treescope-container")[0]


def test_the_page_opens_with_a_heading_naming_what_it_shows():
  model = model_with_arrays()
  html = page(model.blocks)
  assert "<title>Scan[Zam] × 3</title>" in html and "<h1>Scan[Zam] × 3</h1>\n<noscript>" in html
  html = page(model.blocks, title="Blocks <3", description="Three layers & one axis.")
  assert "<h1>Blocks &lt;3</h1>\n<p>Three layers &amp; one axis.</p>\n<noscript>" in html
