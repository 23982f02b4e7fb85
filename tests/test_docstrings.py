"""Every public function and class documents its arguments as Google-style sections
(``Args:``, ``Returns:``, ``Raises:``), the way jax, flax and optax do, so the API pages
list each argument: ``Args`` names every parameter of the signature (a class's are its
constructor's), ``Returns`` says what comes back unless the signature returns ``None``,
and no default shows a private sentinel (``_ALL``, ``mappingproxy({})``), on the API pages
or in ``help()``: a user reads the default as they would write it."""

from __future__ import annotations

import ast
import inspect
import pickle
import re
import textwrap

import pytest

import statefulremat as sr
from docs._signatures import public_path, readable_default
from statefulremat.core._frozen import FrozenMapping

SECTION = re.compile(
  r"^( *)(Args|Arguments|Returns|Yields|Raises|Attributes|Example|Examples):\s*$"
)


def public_objects() -> dict[str, object]:
  """Every public function and class of the package, by the name users type."""
  found = {}
  modules = [("sr", sr), ("sr.nn", sr.nn), ("sr.interop", sr.interop)]
  if hasattr(sr, "policies"):
    modules.append(("sr.policies", sr.policies))
  for prefix, module in modules:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
      obj = getattr(module, name)
      if inspect.ismodule(obj) or not callable(obj):
        continue
      home = getattr(obj, "__module__", "") or ""
      if not home.startswith("statefulremat"):
        continue  # re-exported from jax or flax: documented there
      if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        continue  # an instance (sr.broadcast): documented with its class
      found[f"{prefix}.{name}"] = obj
  return found


PUBLIC = public_objects()


def sections(doc: str) -> dict[str, list[str]]:
  """``{section name: its lines}`` of a Google-style docstring."""
  out: dict[str, list[str]] = {}
  current = None
  indent = 0
  for line in inspect.cleandoc(doc).splitlines():
    match = SECTION.match(line)
    if match:
      current, indent = match.group(2), len(match.group(1))
      out[current] = []
    elif current is not None:
      if line.strip() and len(line) - len(line.lstrip()) <= indent:
        current = None  # back to the body's indentation: the section ended
      else:
        out[current].append(line)
  return out


def documented_names(lines: list[str]) -> set[str]:
  """The argument names an ``Args:`` section lists (``name:`` or ``name (type):``)."""
  entries = [line.strip() for line in lines if line.strip()]
  shallowest = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
  names = set()
  for line in lines:
    if line.strip() and len(line) - len(line.lstrip()) == shallowest:
      match = re.match(r"\s*(\*{0,2}[A-Za-z_][A-Za-z0-9_]*)(?:\s*\([^)]*\))?\s*:", line)
      if match:
        names.add(match.group(1).lstrip("*"))
  return names if entries else set()


def signature_of(obj):
  try:
    return inspect.signature(obj)  # a class: its constructor's, without self
  except (TypeError, ValueError):
    return None


def doc_of(obj) -> str:
  doc = inspect.getdoc(obj) or ""
  if inspect.isclass(obj) and "__init__" in vars(obj) and vars(obj)["__init__"].__doc__:
    doc += "\n\n" + inspect.cleandoc(vars(obj)["__init__"].__doc__)
  return doc


def parameters(obj) -> list[str]:
  sig = signature_of(obj)
  if sig is None:
    return []
  if inspect.isclass(obj) and issubclass(obj, BaseException):
    return []  # an error's one argument is its message
  return [p.name for p in sig.parameters.values() if p.name not in ("self", "cls")]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_args_name_every_parameter(name):
  obj = PUBLIC[name]
  wanted = parameters(obj)
  if not wanted:
    return
  found = sections(doc_of(obj))
  assert "Args" in found, f"{name}: no `Args:` section (parameters: {', '.join(wanted)})"
  listed = documented_names(found["Args"])
  missing = [p for p in wanted if p not in listed]
  assert not missing, f"{name}: `Args:` does not list {missing} (it lists {sorted(listed)})"
  extra = sorted(listed - set(wanted))
  assert not extra, f"{name}: `Args:` lists {extra}, which the signature does not take"


@pytest.mark.parametrize("name", sorted(n for n, o in PUBLIC.items() if inspect.isfunction(o)))
def test_functions_say_what_they_return(name):
  obj = PUBLIC[name]
  sig = signature_of(obj)
  if sig is not None and sig.return_annotation in (None, "None"):
    return
  found = sections(doc_of(obj))
  assert "Returns" in found or "Yields" in found, f"{name}: no `Returns:` section"


PRIVATE = re.compile(r"\b_[A-Za-z]\w*|MappingProxyType|mappingproxy|object at 0x|<function ")


def source_defaults(obj) -> dict[str, str]:
  """``{parameter: its default's source text}``: what the API page shows
  (``autodoc_preserve_defaults``), read as Sphinx reads it."""
  fn = obj.__init__ if inspect.isclass(obj) else obj
  fn = inspect.unwrap(fn)
  try:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  except (OSError, TypeError, SyntaxError):
    return {}
  node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
  args = node.args
  source = textwrap.dedent(inspect.getsource(fn))
  positional = args.posonlyargs + args.args
  pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
  pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
  return {a.arg: ast.get_source_segment(source, d) or "" for a, d in pairs}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_defaults_read_as_users_write_them(name):
  obj = PUBLIC[name]
  fn = inspect.unwrap(obj.__init__ if inspect.isclass(obj) else obj)
  namespace = getattr(fn, "__globals__", {})
  shown = {k: readable_default(v, namespace) for k, v in source_defaults(obj).items()}
  private = {k: v for k, v in shown.items() if PRIVATE.search(v)}
  assert not private, f"{name}: the API page would show private defaults: {private}"


def test_return_annotations_name_public_paths():
  public = {n for n in vars(sr) if not n.startswith("_")}
  assert public_path("~statefulremat.core._state.State", public) == "~statefulremat.State"
  assert public_path("statefulremat.core._graph.GraphDef | None", public) == (
    "statefulremat.GraphDef | None"
  )
  assert readable_default("_ALL", {"_ALL": FrozenMapping({True: 0})}) == "{True: 0}"
  assert readable_default("_EMPTY", {"_EMPTY": FrozenMapping()}) == "{}"
  assert readable_default("_MISSING", {"_MISSING": object()}) == "_MISSING"  # no readable repr


def public_callables() -> dict[str, object]:
  """Every public function and class (its constructor) and each class's public methods,
  inherited ones included: what ``help()`` and IPython's ``?`` show a signature of."""
  found = dict(PUBLIC)
  for name, obj in PUBLIC.items():
    if not inspect.isclass(obj):
      continue
    for attr in dir(obj):
      if attr.startswith("_"):
        continue
      try:
        member = getattr(obj, attr)
      except AttributeError:
        continue
      if inspect.isfunction(member) or inspect.ismethod(member):
        found[f"{name}.{attr}"] = member
  return found


def named_function(value) -> bool:
  """Whether a function default reads as its name (``<function zeros at 0x…>``), as
  flax.nnx's initializer and ``promote_dtype`` defaults do: JAX's and flax's functions,
  and ours defined by name; never a lambda or a nested function of ours."""
  fn = getattr(value, "__wrapped__", value)  # jax.nn.tanh is a PjitFunction
  if not (getattr(fn, "__module__", "") or "").startswith("statefulremat"):
    return True
  return "<" not in getattr(fn, "__qualname__", "<")


CALLABLES = public_callables()


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_help_shows_defaults_as_users_write_them(name):
  # help(), IPython's `?` and inspect.signature show a default's repr, not its source
  # (what the API pages show): a mapping reads as its dict literal, no private name.
  sig = signature_of(CALLABLES[name])
  if sig is None:
    return
  assert "mappingproxy" not in str(sig), f"{name}{sig}"
  unreadable = {}
  for parameter in sig.parameters.values():
    if parameter.default is inspect.Parameter.empty:
      continue
    shown = repr(parameter.default)
    private = shown.startswith("_") or "._" in shown or re.search(r"\b_[A-Z]\w*", shown)
    anonymous = " at 0x" in shown and not named_function(parameter.default)
    if private or anonymous or "mappingproxy" in shown:
      unreadable[parameter.name] = shown
  assert not unreadable, f"{name}: help() shows defaults users cannot read: {unreadable}"


def test_mapping_defaults_are_immutable_and_equal_their_literals():
  sig = inspect.signature(sr.vmap)
  axes = sig.parameters["variable_axes"].default
  assert axes == {True: 0} and repr(axes) == "{True: 0}" and hash(axes) == hash(axes)
  with pytest.raises(TypeError):
    axes[True] = 1  # type: ignore[index]
  assert axes == {True: 0} and pickle.loads(pickle.dumps(axes)) == axes
  assert str(inspect.signature(sr.scan)).count("variable_axes: 'Mapping[Any, Any]' = {}") == 1


def test_the_sections_are_read_as_written():
  doc = """Adds.

  Args:
    x: the first.
    y (int): the second,
      on two lines.
    **kwargs: the rest.

  Returns:
    the sum.
  """
  found = sections(doc)
  assert documented_names(found["Args"]) == {"x", "y", "kwargs"}
  assert found["Returns"] == ["  the sum."]
