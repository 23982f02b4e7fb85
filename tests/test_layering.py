"""Imports run one way: the floors of the house, read from its import statements.

The package's folders are its floors (../shared/DESIGN.md, "The pieces"), bottom up:

  core/                 Variables, filters, State, the graph walk, Module, Rngs, stacks
  transforms/ display/ checkpoint/ distributed/ optim/   each built on the core alone
  nn/ policies/         layers, on the core and the transforms' public names;
                        sr.policies' presets, on the transforms
  interop/              weights from flax, on the core
  the package itself    ``__init__``

A file imports only from floors below its own and from its own folder, function-level
imports included, and never in a cycle. Inside the core the files keep an order of their
own (errors first, stacks last). The core draws itself through the renderers the display
floor registers (``core._display_hooks``): it imports nothing above it, not even there.
"""

import ast
import functools
import pathlib
import pickle
import pickletools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from statefulremat.core._bookkeeping import DEFINED_IN

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "statefulremat"

FLOORS = [
  {"core"},
  {"transforms", "display", "checkpoint", "distributed", "optim"},
  {"nn", "policies"},
  {"interop"},
  {"__init__"},
]
FLOOR_OF = {name: i for i, names in enumerate(FLOORS) for name in names}
TOP = len(FLOORS) - 1

CORE_ORDER = [
  {"_caches"},
  {"_errors", "_display_hooks", "_bookkeeping", "_frozen"},
  {"_tracing"},
  {"_variables", "_graph_cache"},
  {"_filters", "_containers", "_kinds"},
  {"_state"},
  {"_module"},
  {"_graph", "_rngs", "_graph_lock"},
  {"_graph_build"},
  {"_graph_diff", "_pytree", "_split_merge", "_iter_graph"},
  {"_stacks"},
  {"_pattern_stack"},
  {"_stacking"},
]
CORE_LAYER = {name: i for i, names in enumerate(CORE_ORDER) for name in names}


def folder(module: str) -> str:
  """The floor unit of a dotted module name inside the package: `transforms._scan` ->
  `transforms`, `nn` -> `nn`, the package's own `__init__` -> `__init__`."""
  return module.split(".")[0] or "__init__"


@functools.cache
def imports() -> tuple:
  """``(file, importer module, imported module, enclosing function or None)``; module
  names are dotted inside the package, ``""`` for the package's ``__init__``. Read once:
  every test here walks the same files."""
  return tuple(_imports())


def _imports():
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    is_init = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_init else parts)
    package = parts[:-1]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.level:
        base = package[: len(package) - node.level + 1]
        targets = (
          [".".join(base + [node.module])]
          if node.module
          else [".".join(base + [alias.name]) for alias in node.names]
        )
      elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
        "statefulremat"
      ):
        targets = [node.module.partition(".")[2]]
      elif isinstance(node, ast.Import):
        targets = [
          a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "statefulremat"
        ]
      else:
        continue
      function, up = None, node
      while up in parents:
        up = parents[up]
        if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
          function = up.name
          break
      for target in targets:
        yield path.relative_to(PACKAGE), module, target, function


def test_every_folder_is_a_floor_and_no_private_file_sits_at_the_top():
  units = {folder(m) for _, m, _, _ in imports()} | {folder(t) for _, _, t, _ in imports()}
  assert units <= set(FLOOR_OF), f"give these a floor: {sorted(units - set(FLOOR_OF))}"
  top_files = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert top_files == ["__init__.py"]  # the demo is examples/demo.py, outside the package


def test_imports_run_down_the_floors():
  wrong = []
  for file, module, target, function in imports():
    here, there = folder(module), folder(target)
    where = f" (in {function})" if function else ""
    if here == there or FLOOR_OF[here] == FLOOR_OF[there] == TOP:
      continue  # the package itself: its files among themselves (no cycle, below)
    if target == "" and FLOOR_OF[here] != TOP:
      wrong.append(f"{file}{where} imports the whole package")
    elif FLOOR_OF[there] >= FLOOR_OF[here]:
      wrong.append(f"{file}{where} imports {target} (floor {FLOOR_OF[there]} >= {FLOOR_OF[here]})")
  assert not wrong, "imports that do not run down the floors:\n  " + "\n  ".join(wrong)


def test_other_floors_are_reached_through_their_packages():
  """Above the core (whose files keep an order of their own, below), a file reaches
  another folder through that folder's package: the names its ``__init__`` gives."""
  wrong = []
  for file, module, target, function in imports():
    here, there = folder(module), folder(target)
    if here == there or there == "core" or FLOOR_OF[here] == TOP:
      continue
    private = [part for part in target.split(".") if part.startswith("_")]
    if private:
      where = f" (in {function})" if function else ""
      wrong.append(f"{file}{where} imports {target}: {private[0]} is private to {there}/")
  assert not wrong, "import the folder's package instead:\n  " + "\n  ".join(wrong)


def test_the_core_keeps_its_order_and_never_reaches_up():
  wrong = []
  for file, module, target, function in imports():
    if folder(module) != "core" or module == "core":
      continue
    if folder(target) != "core":
      wrong.append(f"{file} imports {target}")
      continue
    if target == "core":
      continue
    here, there = CORE_LAYER[module.split(".")[1]], CORE_LAYER[target.split(".")[1]]
    if here <= there and module != target:
      where = f" (in {function})" if function else ""
      wrong.append(f"{file}{where} imports {target} (core layer {there} >= {here})")
  assert not wrong, "\n  ".join(wrong)


def test_every_core_file_has_its_place():
  names = {p.stem for p in (PACKAGE / "core").glob("_*.py")} - {"__init__"}
  assert names == set(CORE_LAYER), sorted(names ^ set(CORE_LAYER))


@pytest.mark.parametrize("unit", sorted(set(FLOOR_OF) - {"__init__"} | {"top"}))
def test_no_import_cycle_inside_a_folder(unit):
  def unit_of(module):
    return "top" if FLOOR_OF[folder(module)] == TOP else folder(module)

  edges: dict[str, set] = {}
  for _, module, target, _ in imports():
    if unit_of(module) == unit_of(target) == unit and module != target:
      edges.setdefault(module, set()).add(target)

  done: set = set()  # modules whose imports hold no cycle: each is walked once

  def visit(node, stack):
    if node in stack:
      raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node) :] + [node])}")
    if node in done:
      return
    for nxt in edges.get(node, ()):
      visit(nxt, stack + [node])
    done.add(node)

  for start in edges:
    visit(start, [])


# Public objects pickle and load back as they were.


def _pickled():
  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  return {
    "Param": sr.Param(jnp.arange(3.0)),
    "State": sr.state(model),
    "Rngs": sr.Rngs(0, dropout=1),
    "Linear": model,
  }


@pytest.mark.parametrize("kind", ["Param", "State", "Rngs", "Linear"])
def test_pickles_round_trip(kind):
  value = _pickled()[kind]
  again = pickle.loads(pickle.dumps(value))
  assert type(again) is type(value)
  if kind == "Param":
    np.testing.assert_array_equal(again.value, value.value)
  elif kind == "State":
    assert again.flat().keys() == value.flat().keys()
    for path, array in value.flat().items():
      np.testing.assert_array_equal(again.flat()[path], array)
  elif kind == "Rngs":  # the same keys, stream by stream
    assert (jax.random.key_data(again.dropout()) == jax.random.key_data(value.dropout())).all()
    assert (jax.random.key_data(again()) == jax.random.key_data(value())).all()
  else:
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(again(x), value(x))


# A pickle names each class by the public module it is imported from (statefulremat.State,
# statefulremat.nn.Dropout), never the private file that defines it: moving files breaks
# no pickle. The package's __init__ files set it (core/_bookkeeping.name_public_classes).

PUBLIC_MODULES = (sr, sr.nn, sr.interop)


def _public_classes(module) -> dict[str, type]:
  return {
    name: value
    for name, value in vars(module).items()
    if isinstance(value, type)
    and not name.startswith("_")
    and value.__module__.split(".")[0] == "statefulremat"
  }


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_public_classes_name_the_public_module_they_come_from(module):
  classes = _public_classes(module)
  assert classes or module is sr.interop  # sr.interop exports functions only
  wrong = {
    name: cls.__module__
    for name, cls in classes.items()
    if "._" in cls.__module__ or getattr(sys.modules[cls.__module__], cls.__qualname__) is not cls
  }
  assert not wrong, f"classes whose __module__ is not where users import them: {wrong}"
  assert sr.Sequential.__module__ == "statefulremat.nn"  # exported twice: documented in nn


def test_classes_made_later_keep_their_own_module():
  class Block(sr.Module):
    def __init__(self, rngs):
      self.linear = sr.nn.Linear(2, 2, rngs=rngs)

  assert Block.__module__ == __name__ and DEFINED_IN not in vars(Block)
  stack = sr.vmap(Block, axis_size=2)  # a class form's stack class: not a public class
  assert stack.__module__ == __name__ and DEFINED_IN not in vars(stack)


def test_public_classes_keep_their_doctests_in_their_own_files():
  # doctest looks for a class's examples, and its methods', in the module its __module__
  # names; ../conftest.py points it at the file that defines the class instead.
  import doctest

  import statefulremat.core._state as defining

  def found(module):
    return {t.name for t in doctest.DocTestFinder().find(module) if t.examples}

  assert {"statefulremat.core._state.State", "statefulremat.core._state.State.filter"} <= (
    found(defining)
  )
  assert not {name for name in found(sr) if name.startswith("statefulremat.State")}


class _Net(sr.Module):
  def __init__(self, rngs):
    self.w = sr.Param(jnp.arange(3.0), note={"tags": ["a", "b"]})  # metadata, frozen
    self.mean = sr.BatchStat(jnp.zeros(3))
    self.cache = sr.Cache(jnp.ones(2))
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)
    self.rope = sr.nn.RoPE(4)
    self.blocks = sr.ModuleList([sr.nn.Dropout(0.1, rngs=rngs)])
    self.heads = sr.ModuleDict({"a": sr.Sequential(sr.nn.Dropout(0.2, rngs=rngs))})

  def __call__(self, x):
    return self.drop(x * self.w)


def _public_objects():
  net = _Net(sr.Rngs(0, dropout=1))
  graphdef, state = sr.split(net)
  plan = dict(n=4, lengths=(2, 2), policy_name="nothing_saveable", evals=12, temp_bytes=8)
  plan.update(memory_budget=None, candidates=(), carry_bytes=4, layer_bytes=4)
  return {
    "State": state,
    "GraphDef": graphdef,
    "Module": net,
    "Dropout": sr.nn.Dropout(0.5, rngs=sr.Rngs(0)),
    "Rngs": sr.Rngs(0, dropout=1),
    "Param": sr.Param(jnp.arange(3.0)),
    "Intermediate": sr.Intermediate((jnp.ones(2),)),
    "OptState": sr.OptState(jnp.zeros(2)),
    "LoRAParam": sr.nn.LoRAParam(jnp.ones(2)),
    "filter": sr.Any(sr.Not(sr.All(sr.Param, sr.PathContains("w"))), "cache", True, None),
    "RematPlan": sr.RematPlan(**plan),
    "PipelineSpec": sr.PipelineSpec(microbatches=4, schedule="circular", repeats=2),
    "Summary": sr.summary(net, jnp.ones(3)),
    "StateMismatchError": sr.StateMismatchError("paths differ"),
    "TransformError": sr.TransformError("lengths do not divide"),
    "broadcast": sr.broadcast,
    "Linear": sr.nn.Linear(2, 3, rngs=sr.Rngs(0)),
  }


def _data(array):
  return (
    jax.random.key_data(array) if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key) else array
  )


def _module_names(data: bytes) -> set[str]:
  """The modules a protocol-2 pickle imports from (its GLOBAL opcodes)."""
  return {arg.split()[0] for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def _pickle_names_public_paths_only(value):
  data = pickle.dumps(value, protocol=2)
  ours = {m for m in _module_names(data) if m.split(".")[0] == "statefulremat"}
  assert ours and all("._" not in m for m in ours), ours
  newest = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
  named = {a for _, a, _ in pickletools.genops(newest) if str(a).startswith("statefulremat")}
  assert named <= {m.__name__ for m in PUBLIC_MODULES}, named
  return pickle.loads(newest)


PICKLED = ["State", "GraphDef", "Module", "Dropout", "Rngs", "Param", "Intermediate"]
PICKLED += ["OptState", "LoRAParam", "filter", "RematPlan", "PipelineSpec", "Summary"]
PICKLED += ["StateMismatchError", "TransformError", "broadcast", "Linear"]


@pytest.mark.parametrize("kind", PICKLED)
def test_pickles_name_public_paths_and_round_trip(kind):
  objects = _public_objects()
  assert list(objects) == PICKLED
  value = objects[kind]
  again = _pickle_names_public_paths_only(value)
  assert type(again) is type(value)
  assert repr(again) == repr(value)
  if kind == "broadcast":
    assert again is sr.broadcast
  if kind in ("filter", "RematPlan", "PipelineSpec", "GraphDef"):
    assert again == value
  elif kind == "State":
    assert again.flat().keys() == value.flat().keys()
    for path, variable in value.flat_variables().items():
      twin = again.flat_variables()[path]
      assert type(twin) is type(variable) and twin.metadata == variable.metadata
      np.testing.assert_array_equal(_data(twin.value), _data(variable.value))
    sr.update(_Net(sr.Rngs(9, dropout=2)), again)
  elif kind == "Module":
    x = jnp.ones(3)
    np.testing.assert_array_equal(again.eval()(x), value.eval()(x))
  elif kind == "Summary":
    assert str(again) == str(value)
  elif kind == "Linear":
    assert again.promote_dtype is sr.nn.promote_dtype
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(again(x), value(x))


def test_nn_builds_on_the_core_and_the_public_names_only():
  """nn/ is built on the public API (DESIGN, "The pieces"): it imports its own files, the
  core (any of it) and, from the transforms' package, only names that are sr's public
  ones (``from ..transforms import scan``, the object ``sr.scan`` is); never a file of
  transforms/, distributed/, display/, checkpoint/, optim/ or interop/, nor the package
  above it."""
  public = {
    name
    for name, value in vars(sr).items()
    if not name.startswith("_") and not isinstance(value, types.ModuleType)
  }
  wrong = []
  for path in sorted((PACKAGE / "nn").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      where = f"nn/{path.name}:{getattr(node, 'lineno', '?')}"
      if isinstance(node, ast.Import):
        wrong += [
          f"{where} import {a.name} (import sr's transforms: `from ..transforms import x`)"
          for a in node.names
          if a.name.split(".")[0] == "statefulremat"
        ]
        continue
      if not isinstance(node, ast.ImportFrom) or node.level == 1:
        continue  # not an import, or one of nn's own files
      if node.level == 0:
        top, _, rest = (node.module or "").partition(".")
        if top != "statefulremat":
          continue  # jax, numpy, the standard library
        module = rest or None
      else:
        module = node.module
      names = [a.name for a in node.names]
      if module == "transforms":
        given = vars(sr.transforms)
        private = [n for n in names if n not in public or given[n] is not vars(sr)[n]]
        if private:
          wrong.append(f"{where} imports {', '.join(private)} from transforms: not sr's")
      elif module is None or module.split(".")[0] != "core":
        wrong.append(f"{where} from ..{module or ''} import {', '.join(names)}")
  assert not wrong, "nn/ reaches past the public API:\n  " + "\n  ".join(wrong)


# The files that each hold one public transform (DESIGN, "The pieces"), by their path
# under transforms/; the others are the machinery they share.
TRANSFORM_FILES = {
  ("accumulate", "_accumulate"),
  ("_autodiff",),
  ("_eval_shape",),
  ("_jit",),
  ("pipeline", "_pipeline"),
  ("_remat",),
  ("_remat_scan",),
  ("memory", "_saved_residuals"),
  ("_scan",),
  ("vmap", "_vmap"),
}


def test_no_transform_reaches_into_another_transforms_file():
  """A file of transforms/ (its folders included) takes from a transform's file only
  what the package exports (``remat_scan``, ``grad``: built on the public transform),
  never its helpers: what two transforms share lives in a file of its own."""
  public = {name for name in vars(sr) if not name.startswith("_")}
  root = PACKAGE / "transforms"
  wrong = []
  for path in sorted(root.rglob("*.py")):
    here = path.relative_to(root).with_suffix("").parts
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if not (isinstance(node, ast.ImportFrom) and node.level and node.module):
        continue
      base = here[: len(here) - node.level]
      if len(here) - node.level < 0:
        continue  # above transforms/: the layering test's business
      target = base + tuple(node.module.split("."))
      if target in TRANSFORM_FILES and target != here:
        for alias in node.names:
          if alias.name not in public:
            wrong.append(f"transforms/{'/'.join(here)} imports {alias.name} from {node.module}")
  assert not wrong, "\n  ".join(["helpers taken from another transform's file:", *wrong])
