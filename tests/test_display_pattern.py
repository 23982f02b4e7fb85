"""Pattern stacks and wide outputs on screen: a long pattern (Gemma 3's five local
layers and a global one, each a ``functools.partial`` with long keyword values) is
named compactly, each element once; ``sr.summary`` keeps rows readable where blocks
return dicts, says "1 layer", and returns a ``str``."""

import functools
import pickle

import jax
import jax.numpy as jnp
import treescope

import statefulremat as sr

D = 4
LOCAL = "local_sliding_window_attention"
LOCAL_NAME = f"partial(Block, attn_type='{LOCAL}', window=1024)"
GLOBAL_NAME = "partial(Block, attn_type='global_full_attention')"


def zeros(key, shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


class Block(sr.Module):
  def __init__(self, *, rngs, attn_type="global", window=None):
    self.linear = sr.nn.Linear(D, D, kernel_init=zeros, rngs=rngs)
    self.attn_type = attn_type

  def __call__(self, x):
    return x + self.linear(x)


class Local(Block):
  pass


class Global(Block):
  pass


def gemma3(length=12):
  local = functools.partial(Block, attn_type=LOCAL, window=1024)
  glob = functools.partial(Block, attn_type="global_full_attention")
  pattern = (local, local, local, local, local, glob)
  return sr.remat_scan(pattern, length=length, lengths=(-(-length // 6),))(rngs=sr.Rngs(0))


def widest(text: str) -> int:
  return max(map(len, text.splitlines()))


# -- a long pattern, compactly ----------------------------------------------------------


def test_a_long_pattern_names_each_element_once_with_a_legend():
  stack = gemma3()
  lines = repr(stack).splitlines()
  assert lines[:4] == [
    "RematScan[Block#1 × 5, Block#2](  # 12 layers: (Block#1 × 5, Block#2) × 2",
    f"  # Block#1 = {LOCAL_NAME}",
    f"  # Block#2 = {GLOBAL_NAME}",
    "  pattern=(",
  ]
  labels = [line.strip() for line in lines if "# position" in line]
  assert labels[0] == "RematScan[Block] × 2(  # position 0 of 6: Block#1, 2 layers (0, 6)"
  assert labels[5] == "RematScan[Block] × 2(  # position 5 of 6: Block#2, 2 layers (5, 11)"
  assert repr(stack).count("partial(") == 2  # the legend's two lines, nothing else


def test_a_long_pattern_stays_within_120_characters_a_line():
  # Before: 731 characters a line (the title spelled all six partials, twice).
  stack = gemma3(length=26)
  assert widest(repr(stack)) <= 120
  assert widest(str(stack)) <= 120
  assert widest(treescope.render_to_text(stack)) <= 120
  # Roundtrip mode also names the module: 123 here, with this file's name.
  roundtrip = treescope.render_to_text(stack, roundtrip_mode=True)
  assert widest(roundtrip) <= 130
  assert roundtrip.startswith(f"<{__name__}.RematScanPattern[Block#1 × 5, Block#2](")
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(stack, compressed=False)
  assert f"Block#1 = {LOCAL_NAME}" in html.replace("&#x27;", "'")


def test_a_position_drawn_alone_keeps_its_label():
  stack = gemma3()
  assert repr(stack.pattern[5]).splitlines()[0] == (
    "RematScan[Block] × 2(  # position 5 of 6: Block#2, 2 layers (5, 11)"
  )


def test_short_patterns_keep_their_names_and_long_runs_a_count():
  stack = sr.remat_scan((Local, Local, Global), length=3, lengths=(1,))(rngs=sr.Rngs(0))
  assert repr(stack).splitlines()[0] == (
    "RematScan[Local, Local, Global](  # 3 layers: (Local, Local, Global) × 1"
  )
  stack = sr.remat_scan((Local,) * 3 + (Global,), length=6, lengths=(2,))(rngs=sr.Rngs(0))
  assert repr(stack).splitlines()[:2] == [
    "RematScan[Local × 3, Global](  # 6 layers: (Local × 3, Global) × 1 + (Local, Local)",
    "  pattern=(",
  ]


def test_a_function_in_a_partial_shows_by_name_not_address():
  Relu = functools.partial(Block, attn_type=jax.nn.relu)
  stack = sr.remat_scan((Relu, Global), length=2, lengths=(1,))(rngs=sr.Rngs(0))
  first = repr(stack).splitlines()[0]
  assert first.startswith("RematScan[partial(Block, attn_type=relu), Global](")
  assert " at 0x" not in repr(stack)


# -- sr.summary -------------------------------------------------------------------------


def test_the_summary_of_a_long_pattern_names_it_compactly():
  stack = gemma3()
  table = sr.summary(stack, jnp.ones((2, D)))
  assert widest(table) <= 120  # before: 736
  root = table.rows[0]
  assert root.class_name == "RematScan[Block#1 × 5, Block#2]"
  assert root.pattern == "12 layers: (Block#1 × 5, Block#2) × 2"
  assert root.legend == (f"Block#1 = {LOCAL_NAME}", f"Block#2 = {GLOBAL_NAME}")
  lines = table.splitlines()
  start = lines.index(
    "(root): RematScan[Block#1 × 5, Block#2], 12 layers: (Block#1 × 5, Block#2) × 2"
  )
  assert lines[start + 1 : start + 4] == [
    f"  Block#1 = {LOCAL_NAME}",
    f"  Block#2 = {GLOBAL_NAME}",
    "  pattern[0]  position 0 of 6: Block#1, 2 layers (0, 6)",
  ]


class Attention(sr.Module):
  """Returns a dict of many outputs, as a decoder block with its cache does."""

  def __init__(self, rngs):
    self.linear = sr.nn.Linear(D, D, kernel_init=zeros, rngs=rngs)

  def __call__(self, x):
    y = self.linear(x)
    names = ["hidden_states", "attention_weights", "residual_stream", "keys", "values"]
    return {**{k: y for k in names}, "mlp": {"pre": y, "post": y}}


class Encoder(sr.Module):
  def __init__(self, rngs):
    self.encoder_block_with_a_long_name = Attention(rngs)

  def __call__(self, x):
    return self.encoder_block_with_a_long_name(x)


def test_dict_outputs_are_cut_to_a_readable_width_keys_kept():
  table = sr.summary(Encoder(sr.Rngs(0)), jnp.ones((2, D)))
  assert widest(table) <= 150  # before: 283
  row = table.rows[1]
  assert row.outputs_text() == "{'attention_weights': f32[2,4], 'hidden_states': f32[2,4], …}"
  assert row.outputs_text(width=1000) == row.outputs[0]  # the whole text, kept
  assert row.outputs[0].count("float32[2,4]") == 7
  # A cut inside a nested dict says the outer one goes on.
  assert row.outputs_text(width=100) == (
    "{'attention_weights': f32[2,4], 'hidden_states': f32[2,4], 'keys': f32[2,4], 'mlp': {…}, …}"
  )


def test_one_layer_is_singular():
  one = sr.remat_scan(Block, lengths=(1,))(rngs=sr.Rngs(0))
  table = sr.summary(one, jnp.ones((2, D)))
  assert "(root): RematScan[Block], 1 layer, L2 norm of each layer's Params" in table
  assert "1 layers" not in table
  pattern = sr.remat_scan((Block,), length=1, lengths=(1,))(rngs=sr.Rngs(0))
  table = sr.summary(pattern)
  assert table.rows[0].params_text() == "20 (1 layer)"
  assert table.rows[0].pattern == "1 layer: (Block) × 1"
  assert "1 layers" not in table and "1 layers" not in repr(pattern)


def test_the_summary_is_its_text():
  model = sr.nn.Linear(3, 2, rngs=sr.Rngs(0))
  table = sr.summary(model, jnp.ones((5, 3)))
  assert isinstance(table, str)
  assert table.splitlines() == table.lines() == str(table).split("\n")
  assert table.splitlines()[2] == "(root)  Linear       8          32 B  float32[5,2]"
  assert repr(table) == str(table) == table
  assert (table.total_params, table.collections, table.rows[0].class_name) == (
    8,
    ["params"],
    "Linear",
  )
  back = pickle.loads(pickle.dumps(table))
  assert type(back) is sr.Summary and back == table and back.total_params == 8
  assert back.norms() == table.norms()
  assert treescope.render_to_text(table).startswith("Summary(  # 8 params, 1 module\n")
