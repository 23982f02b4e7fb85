"""Imports run one way: the floors of the house, read from its import statements.

The package's folders are its floors (../shared/DESIGN.md, "The pieces"), bottom up:

  core/                 Variables, filters, State, the graph walk, Module, Rngs, stacks
  transforms/ display/ checkpoint/ distributed/ optim/   each built on the core alone
  nn/                   layers, on the core and (read at call time) sr's public names
  interop/              weights from flax, on the core
  the package itself    ``__init__``

A file imports only from floors below its own and from its own folder, function-level
imports included, and never in a cycle. Inside the core the files keep an order of their
own (errors first, stacks last). The core draws itself through the renderers the display
floor registers (``core._display_hooks``): it imports nothing above it, not even there.
"""

import ast
import pathlib
import pickle
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "statefulremat"

FLOORS = [
  {"core"},
  {"transforms", "display", "checkpoint", "distributed", "optim"},
  {"nn"},
  {"interop"},
  {"__init__"},
]
FLOOR_OF = {name: i for i, names in enumerate(FLOORS) for name in names}
TOP = len(FLOORS) - 1

CORE_ORDER = [
  {"_errors", "_display_hooks", "_bookkeeping"},
  {"_tracing"},
  {"_variables"},
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


def imports():
  """``(file, importer module, imported module, enclosing function or None)``; module
  names are dotted inside the package, ``""`` for the package's ``__init__``."""
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
      if here == "nn" and function:
        continue  # sr's public names, read at call time (test_nn_builds_on_the_core_...)
      wrong.append(f"{file}{where} imports the whole package")
    elif FLOOR_OF[there] >= FLOOR_OF[here]:
      wrong.append(f"{file}{where} imports {target} (floor {FLOOR_OF[there]} >= {FLOOR_OF[here]})")
  assert not wrong, "imports that do not run down the floors:\n  " + "\n  ".join(wrong)


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

  def visit(node, stack):
    if node in stack:
      raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node) :] + [node])}")
    for nxt in edges.get(node, ()):
      visit(nxt, stack + [node])

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


def test_nn_builds_on_the_core_and_the_public_names_only():
  """nn/ is built on the public API (DESIGN, "The pieces"): it imports its own files, the
  core (any of it) and, from the package, only its public names (``from statefulremat
  import scan``, inside the function that needs it: the package imports nn before it
  binds them), never a file of transforms/, distributed/, display/, checkpoint/, optim/
  or interop/."""
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
          f"{where} import {a.name} (import the public names: `from statefulremat import x`)"
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
      if module is None:
        private = [n for n in names if n not in public]
        if private:
          wrong.append(f"{where} imports {', '.join(private)} from the package: not public")
      elif module.split(".")[0] != "core":
        wrong.append(f"{where} from ..{module} import {', '.join(names)}")
  assert not wrong, "nn/ reaches past the public API:\n  " + "\n  ".join(wrong)


# The files that each hold one public transform (DESIGN, "The pieces"), by their path
# under transforms/; the others are the machinery they share.
TRANSFORM_FILES = {
  ("_accumulate",),
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
