"""statefulremat: PyTorch-like stateful modules with JAX's memory and compile-time tools.

>>> import jax.numpy as jnp, statefulremat as sr
>>> model = sr.nn.Linear(4, 2, rngs=sr.Rngs(0))
>>> model(jnp.ones((3, 4))).shape
(3, 2)
"""

from . import interop as interop
from . import nn as nn
from . import policies as policies
from .checkpoint._files import CheckpointError as CheckpointError
from .checkpoint._save_restore import restore as restore
from .checkpoint._save_restore import save as save
from .checkpoint._sync import SaveHandle as SaveHandle
from .core import _pytree  # noqa: F401  (registers every Module class as a JAX pytree)
from .core._bookkeeping import name_public_classes as _name_public_classes
from .core._containers import ModuleDict as ModuleDict
from .core._containers import ModuleList as ModuleList
from .core._errors import GraphError as GraphError
from .core._errors import StatefulRematError as StatefulRematError
from .core._errors import StateMismatchError as StateMismatchError
from .core._errors import TraceContextError as TraceContextError
from .core._errors import TransformError as TransformError
from .core._errors import folded as _folded
from .core._filters import All as All
from .core._filters import Any as Any
from .core._filters import Not as Not
from .core._filters import PathContains as PathContains
from .core._graph import GraphDef as GraphDef
from .core._iter_graph import iter_graph as iter_graph
from .core._kinds import BatchStat as BatchStat
from .core._kinds import Cache as Cache
from .core._kinds import Intermediate as Intermediate
from .core._kinds import Param as Param
from .core._kinds import RngCount as RngCount
from .core._kinds import RngKey as RngKey
from .core._kinds import RngState as RngState
from .core._module import Module as Module
from .core._rngs import Rngs as Rngs
from .core._rngs import RngStream as RngStream
from .core._split_merge import clone as clone
from .core._split_merge import graphdef as graphdef
from .core._split_merge import merge as merge
from .core._split_merge import pop as pop
from .core._split_merge import split as split
from .core._split_merge import state as state
from .core._split_merge import update as update
from .core._stacking import stack as stack
from .core._stacks import per_layer as per_layer
from .core._stacks import unstack as unstack
from .core._state import State as State
from .core._variables import Variable as Variable
from .display._display import display as display
from .display._summary import Summary as Summary
from .display._summary import SummaryRow as SummaryRow
from .display._summary import summary as summary
from .distributed._sharding import get_partition_spec as get_partition_spec
from .distributed._sharding import logical_to_mesh as logical_to_mesh
from .distributed._sharding import shard as shard
from .nn._sequential import Sequential as Sequential
from .optim._optimizer import Optimizer as Optimizer
from .optim._optimizer import OptState as OptState
from .transforms._autodiff import grad as grad
from .transforms._autodiff import value_and_grad as value_and_grad
from .transforms._class_form import made_class as _made_class
from .transforms._eval_shape import eval_shape as eval_shape
from .transforms._jit import jit as jit
from .transforms._remat import remat as remat
from .transforms._remat_scan import remat_scan as remat_scan
from .transforms._scan import scan as scan
from .transforms._scan_axes import broadcast as broadcast
from .transforms.accumulate._accumulate import accumulate as accumulate
from .transforms.memory._remat_plan import RematPlan as RematPlan
from .transforms.memory._remat_search import plan_remat as plan_remat
from .transforms.memory._saved_residuals import saved_residuals as saved_residuals
from .transforms.pipeline._pipeline import PipelineSpec as PipelineSpec
from .transforms.pipeline._pipeline import pipeline as pipeline
from .transforms.vmap._vmap import vmap as vmap

__version__ = "0.1.0"

# Pickles and reprs name the public path (statefulremat.State), not a file that may move.
# sr.broadcast pickles by name, as the one instance: its class's module says where.
_name_public_classes({**globals(), "broadcast": type(broadcast)}, __name__)
# A class a class form made (sr.scan(Block, ...)) pickles as the call that makes it
# again, by this function's name here.
_made_class.__module__, _made_class.__qualname__ = __name__, "_made_class"


def __getattr__(name: str):
  # sr.RematPlanError and sr.ShardingError, folded into the error kinds: importable, with
  # a warning, for one release.
  if name in ("RematPlanError", "ShardingError"):
    return _folded(f"{__name__}.{name}")
  # A name flax.nnx has and we spell differently says ours (nnx.tabulate -> sr.summary,
  # nnx.Linear -> sr.nn.Linear); dunder and private names (probed by pytest, doctest,
  # pickle, IPython) and names nnx lacks keep Python's plain AttributeError.
  if not name.startswith("_"):
    from .nn import _nnx_names

    text = _nnx_names.message(__name__, name, name in vars(nn))
    if text is not None:
      raise AttributeError(text, name=name, obj=None)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
