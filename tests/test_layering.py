"""Imports run one way: the package's layers, read from its import statements.

From the bottom: errors; traces (which trace a Variable belongs to, the structure
epoch); Variables; filters, containers and the shipped Variable kinds; State; Module;
split/merge and Rngs; GraphDef differences and modules as pytrees; stacks (the layer
axis as data); the transforms; and on top everything built on them (optimizer,
sharding, checkpoints, summary, display, treescope, nn, interop, the demo). A file
imports only from layers below its own (the transforms and the top layer also among
themselves, without cycles), function-level imports included. The one exception: the
core's repr hooks (``__repr__``, ``__treescope_repr__`` and the helpers named
``*repr*``) draw with the display layer. Nothing outside ``_transforms/`` imports from
it but the package's ``__init__``.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "statefulremat"

LAYERS = [
    {"_errors"},
    {"_tracing"},
    {"_variables"},
    {"_filters", "_containers", "_kinds"},
    {"_state"},
    {"_module"},
    {"_graph", "_rngs", "_graph_lock"},
    {"_graph_diff", "_pytree", "_split_merge"},
    {"_stacks"},
    {"_transforms"},
    {"_optimizer", "_sharding", "_checkpoint_files", "_checkpoint_meta",
     "_checkpoint_sync", "_checkpoint", "_summary", "_summary_norms",
     "_summary_outputs", "_display", "_treescope", "_treescope_adapter",
     "_treescope_arrays", "_repr", "_demo", "__main__", "nn", "interop"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
TRANSFORMS, TOP = LAYER_OF["_transforms"], len(LAYERS) - 1
DISPLAY = {"_repr", "_treescope"}


def unit(module: str) -> str:
  """The layer unit of a dotted module name inside the package: `_transforms._scan`
  -> `_transforms`, `nn._linear` -> `nn`, `_graph` -> `_graph`."""
  return module.split(".")[0]


def imports():
  """``(file, importer module, imported module, enclosing function or None)``."""
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    is_init = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_init else parts)
    package = parts[:-1] if not is_init else parts[:-1]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.level:
        base = package[:len(package) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
        targets = [target] if node.module else [
            ".".join(base + [alias.name]) for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
          "statefulremat"):
        targets = [node.module.partition(".")[2] or "__init__"]
      elif isinstance(node, ast.Import):
        targets = [a.name.partition(".")[2] or "__init__" for a in node.names
                   if a.name.split(".")[0] == "statefulremat"]
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


def is_repr_hook(function) -> bool:
  return function is not None and "repr" in function


def test_every_file_has_a_layer():
  units = {unit(m) for _, m, _, _ in imports()} - {""}
  assert units <= set(LAYER_OF), f"give these a layer: {sorted(units - set(LAYER_OF))}"


def test_imports_run_one_way():
  wrong = []
  for file, module, target, function in imports():
    if module == "" or target in ("", "__init__"):  # the package's own __init__
      if module and target in ("", "__init__") and LAYER_OF[unit(module)] != TOP:
        wrong.append(f"{file} imports the whole package")
      continue
    here, there = LAYER_OF[unit(module)], LAYER_OF[unit(target)]
    if unit(target) == unit(module) or (here == there and here in (TRANSFORMS, TOP)):
      continue
    if here < there and is_repr_hook(function) and unit(target) in DISPLAY:
      continue
    if here <= there:
      where = f" (in {function})" if function else ""
      wrong.append(f"{file}{where} imports {target} (layer {there} >= {here})")
  assert not wrong, "imports that run upwards:\n  " + "\n  ".join(wrong)


def test_nothing_outside_the_transforms_imports_them():
  wrong = [f"{file} imports {target}" for file, module, target, _ in imports()
           if unit(target) == "_transforms" and module != "" and
           unit(module) != "_transforms"]
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("layer", [TRANSFORMS, TOP])
def test_no_cycles_within_a_layer(layer):
  edges: dict[str, set] = {}
  for _, module, target, function in imports():
    if module and LAYER_OF.get(unit(module)) == layer and (
        LAYER_OF.get(unit(target)) == layer) and not is_repr_hook(function):
      edges.setdefault(module, set()).add(target)

  def visit(node, stack):
    if node in stack:
      raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}")
    for nxt in edges.get(node, ()):
      visit(nxt, stack + [node])

  for start in edges:
    visit(start, [])
