"""treescope's HTML for a 100-layer remat_scan model with BatchNorm, in a real headless
Chromium (Debian's chromium and chromedriver, driven by selenium): it draws, the class
names and the named layer axis are visible, and a folded Param unfolds on a click into
an array figure whose layer axis is labelled. The page ``sr.display(model, path=...)``
writes draws a stacked BatchStat as one layers × features image in a screenshot, and
with JavaScript off shows the tree as text, not "(Loading...)"."""

import re
import struct

import jax.numpy as jnp
import pytest
import treescope

import statefulremat as sr
from tests._browser import HEIGHT, WIDTH, start_browser

LAYERS, FEATURES = 100, 8
TIMEOUT = 30  # seconds: only ever reached when something is broken
# A figure's axis over all the layers, e.g. "layers (axis 0): 100", "layers: 100".
FIGURE_LABEL = re.compile(rf"^layers\b.*\b{LAYERS}$", re.MULTILINE)


class NormBlock(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x)))


@pytest.fixture(scope="module")
def driver():
  browser = start_browser()
  try:
    yield browser
  finally:
    browser.quit()


@pytest.fixture(scope="module")
def model():
  deep = sr.remat_scan(NormBlock, lengths=(10, 10))(FEATURES, rngs=sr.Rngs(0))
  assert deep.linear.kernel.shape == (LAYERS, FEATURES, FEATURES)
  assert deep.norm.mean.shape == (LAYERS, FEATURES)  # a BatchStat per layer
  return deep


@pytest.fixture(scope="module")
def url(driver, model, tmp_path_factory):  # driver first: a skip builds no model
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(model, compressed=True)  # as notebooks get it
  path = tmp_path_factory.mktemp("browser") / "model.html"
  path.write_text(html, encoding="utf-8")
  return path.as_uri()


def open_page(driver, url):
  """Loads the page; returns the shadow root treescope draws into, once it has drawn."""
  from selenium.common.exceptions import NoSuchShadowRootException
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  driver.get(url)
  host = driver.find_element(By.CSS_SELECTOR, "treescope-container")
  # The content arrives deflated in a <template>; treescope's script inflates it
  # asynchronously into the container's open shadow root.
  WebDriverWait(driver, TIMEOUT, ignored_exceptions=(NoSuchShadowRootException,)).until(
    lambda _: host.shadow_root.find_elements(By.CSS_SELECTOR, ".treescope_root")
  )
  return host.shadow_root


def shown(elements):
  return [e for e in elements if e.is_displayed() and e.size["width"] > 0 and e.size["height"] > 0]


def png_size(path) -> tuple[int, int]:
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
  return struct.unpack(">II", data[16:24])


def test_screenshot(driver, url, tmp_path):
  open_page(driver, url)
  png = tmp_path / "model.png"
  assert driver.save_screenshot(png)
  width, height = png_size(png)
  assert width == WIDTH and HEIGHT // 2 < height <= HEIGHT
  assert png.stat().st_size > 10_000  # coloured text, not a blank page


def test_class_names_and_layer_axis_are_visible(driver, url, model):
  from selenium.webdriver.common.by import By

  root = open_page(driver, url)
  labels = [e.text for e in shown(root.find_elements(By.CSS_SELECTOR, ".foldable_node > label"))]
  # The root names the user's class and the layer count, not the generated class.
  assert f"RematScan[NormBlock] × {LAYERS}(" in labels[0], labels[0]
  for name in ("Linear", "BatchNorm", "Param", "BatchStat"):
    assert any(name in label for label in labels), (name, labels)
  # Every stacked variable (Linear's 2 Params, BatchNorm's 2 Params and 2 BatchStats)
  # shows its layer axis by name in its summary.
  summaries = [label for label in labels if f"layers:{LAYERS}" in label]
  assert len(summaries) >= 6, labels


def test_clicking_a_folded_param_draws_its_layer_axis(driver, url, tmp_path):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  root = open_page(driver, url)

  def label_of(node):
    return node.find_element(By.CSS_SELECTOR, ":scope > label")

  def is_open(node):
    return label_of(node).find_element(By.CSS_SELECTOR, ":scope > input").is_selected()

  params = [
    n
    for n in shown(root.find_elements(By.CSS_SELECTOR, ".foldable_node"))
    if label_of(n).text.startswith("Param") and f"layers:{LAYERS}" in n.text
  ]
  assert len(params) >= 4, "Linear's and BatchNorm's Params should show a layer axis"
  # Linear's kernel: random (not constant), so its figure has many colours to check
  # for. treescope's layout may start it open (the first nodes of a page are, and the
  # kernel is Linear's first attribute): folded first, it shows no figure.
  kernel = f"float32(layers:{LAYERS}, {FEATURES}, {FEATURES})"
  (param,) = [n for n in params if kernel in n.text]
  if is_open(param):
    label_of(param).click()
    WebDriverWait(driver, TIMEOUT).until(lambda _: not is_open(param))
  assert not FIGURE_LABEL.search(param.text)  # folded: no figure shown

  label_of(param).click()
  WebDriverWait(driver, TIMEOUT).until(lambda _: is_open(param))
  # Its value shows its summary; open (a click where treescope's layout folded it), it
  # draws one layer with a slider over the layers, and each layer's norm.
  value = param.find_element(By.CSS_SELECTOR, ".foldable_node")
  assert kernel in label_of(value).text
  if not is_open(value):
    label_of(value).click()
  WebDriverWait(driver, TIMEOUT).until(lambda _: FIGURE_LABEL.search(value.text))

  texts = [e.text for e in shown(value.find_elements(By.CSS_SELECTOR, "div"))]
  assert any(FIGURE_LABEL.fullmatch(t) for t in texts), value.text  # the norms' axis
  assert "layers (axis 0)" in value.text  # the slider's
  assert "L2 norm of each layer: least" in value.text
  canvas = shown(value.find_elements(By.CSS_SELECTOR, "canvas"))
  assert len(canvas) == 2, "one layer's figure and the norms' strip"
  colours = driver.execute_script(
    """
      const c = arguments[0];
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      for (let i = 0; i < d.length; i += 4) seen.add(d.slice(i, i + 4).join());
      return seen.size;""",
    canvas[0],
  )
  assert colours > 32, f"the figure's canvas is (nearly) blank: {colours} colours"
  assert driver.save_screenshot(tmp_path / "unfolded.png")


# -- the page sr.display writes ---------------------------------------------------------


@pytest.fixture(scope="module")
def page(driver, tmp_path_factory):  # driver first: a skip builds no model
  """The page of a model whose BatchNorm means differ by layer and feature."""
  deep = sr.remat_scan(NormBlock, lengths=(10, 10))(FEATURES, rngs=sr.Rngs(0))
  layer, feature = jnp.arange(LAYERS)[:, None], jnp.arange(FEATURES)[None, :]
  deep.norm.mean.value = jnp.sin(layer / 10 + feature)
  path = tmp_path_factory.mktemp("page") / "model.html"
  sr.display(deep, path=path)
  return path


def variable_canvases(driver, root):
  """Each figure's canvas with the label of its Variable and of its value."""
  return driver.execute_script(
    """
      const out = [];
      for (const canvas of arguments[0].querySelectorAll('canvas')) {
        const labels = [];
        for (let n = canvas; n && labels.length < 2; n = n.parentNode) {
          if (n.classList && n.classList.contains('foldable_node')) {
            labels.push(n.querySelector(':scope > label').innerText);
          }
        }
        out.push([canvas, labels[1] || '', labels[0] || '']);
      }
      return out;""",
    root,
  )


def test_the_page_draws_a_stacked_batchstat_as_one_layers_by_features_image(driver, page):
  from PIL import Image
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  driver.get(page.as_uri())
  root = driver.find_element(By.CSS_SELECTOR, "treescope-container").shadow_root
  # Drawn as it loads: no "(Loading...)" step, and the figures are open at once.
  WebDriverWait(driver, TIMEOUT).until(
    lambda _: len(root.find_elements(By.CSS_SELECTOR, "canvas")) >= 7
  )
  means = [
    (canvas, value)
    for canvas, variable, value in variable_canvases(driver, root)
    if variable.startswith("BatchStat(") and " ±0.0 " not in value  # var is constant
  ]
  assert len(means) == 1, "the BatchStat mean should have one figure"
  canvas, value = means[0]
  assert value.startswith(f"<float32(layers:{LAYERS}, {FEATURES})"), value
  # One image, the layers across (7 pixels a cell), no slider: all layers at a glance.
  width, height = canvas.size["width"], canvas.size["height"]
  assert LAYERS * 7 <= width < LAYERS * 7 + 40 and FEATURES * 7 <= height < FEATURES * 7 + 40
  figure = canvas.find_element(By.XPATH, "./ancestor::*[contains(@class, 'arrayviz_container')]")
  # The layer axis is an axis of the image ("layers (axis 0): 100"), not a slider's:
  # the one range input is treescope's zoom.
  assert f"layers (axis 0): {LAYERS}" in figure.text, figure.text
  assert len(shown(figure.find_elements(By.CSS_SELECTOR, "input[type=range]"))) == 1

  driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", canvas)
  box = driver.execute_script("return arguments[0].getBoundingClientRect().toJSON();", canvas)
  png = page.parent / "mean.png"
  assert driver.save_screenshot(png)
  with Image.open(png) as shot:
    pixels = shot.convert("RGB").crop(
      (int(box["left"]) + 8, int(box["top"]) + 8, int(box["right"]) - 8, int(box["bottom"]) - 8)
    )
    colours = pixels.getcolors(maxcolors=1 << 16) or []
  painted = sum(n for n, rgb in colours if rgb != (255, 255, 255))
  assert painted > 0.9 * pixels.width * pixels.height, "the image's box is (nearly) blank"
  assert len(colours) > 16, f"the image has {len(colours)} colours: not a varying mean"


def test_without_javascript_the_page_shows_the_tree_as_text(page):
  from selenium.webdriver.common.by import By

  browser = start_browser(javascript=False)
  try:
    browser.get(page.as_uri())
    text = browser.find_element(By.TAG_NAME, "body").text
    png = page.parent / "no_script.png"
    assert browser.save_screenshot(png)
  finally:
    browser.quit()
  assert "(Loading...)" not in text
  heading, _, tree = text.partition("\n")  # the page's heading names the model
  assert heading == f"RematScan[NormBlock] × {LAYERS}", text[:200]
  assert tree.lstrip("\n").startswith(f"RematScan[NormBlock] × {LAYERS}(\n"), text[:200]
  assert f"mean=BatchStat(\n      value=<jax.Array float32(layers:{LAYERS}, {FEATURES}) ≈" in text
  assert png.stat().st_size > 10_000  # the text drawn, not a blank page
