"""statefulremat: PyTorch-like stateful modules with JAX's memory and compile-time tools.

>>> import jax.numpy as jnp, statefulremat as sr
>>> model = sr.nn.Linear(4, 2, rngs=sr.Rngs(0))
>>> model(jnp.ones((3, 4))).shape
(3, 2)
"""

from ._containers import ModuleDict as ModuleDict
from ._containers import ModuleList as ModuleList
from ._errors import GraphError as GraphError
from ._errors import StatefulRematError as StatefulRematError
from ._errors import StateMismatchError as StateMismatchError
from ._errors import TraceContextError as TraceContextError
from ._errors import TransformError as TransformError
from ._filters import All as All
from ._filters import Any as Any
from ._filters import Not as Not
from ._filters import PathContains as PathContains
from ._graph import GraphDef as GraphDef
from ._split_merge import clone as clone
from ._split_merge import graphdef as graphdef
from ._split_merge import merge as merge
from ._split_merge import split as split
from ._split_merge import state as state
from ._split_merge import update as update
from ._module import Module as Module
from ._optimizer import OptState as OptState
from ._optimizer import Optimizer as Optimizer
from ._rngs import Rngs as Rngs
from ._rngs import RngStream as RngStream
from ._sharding import ShardingError as ShardingError
from ._sharding import get_partition_spec as get_partition_spec
from ._sharding import logical_to_mesh as logical_to_mesh
from ._sharding import shard as shard
from ._stacks import stack as stack
from ._stacks import unstack as unstack
from ._state import State as State
from . import _pytree  # noqa: F401  (registers every Module class as a JAX pytree)
from ._checkpoint import restore as restore
from ._checkpoint import save as save
from ._checkpoint_files import CheckpointError as CheckpointError
from ._checkpoint_sync import SaveHandle as SaveHandle
from ._summary import Summary as Summary
from ._summary import SummaryRow as SummaryRow
from ._summary import summary as summary
from ._display import display as display
from ._transforms._autodiff import grad as grad
from ._transforms._autodiff import value_and_grad as value_and_grad
from ._transforms._eval_shape import eval_shape as eval_shape
from ._transforms._jit import jit as jit
from ._transforms._remat import remat as remat
from ._transforms._saved_residuals import saved_residuals as saved_residuals
from ._transforms._remat_plan import RematPlan as RematPlan
from ._transforms._remat_plan import RematPlanError as RematPlanError
from ._transforms._remat_scan import plan_remat as plan_remat
from ._transforms._remat_scan import remat_scan as remat_scan
from ._transforms._scan import broadcast as broadcast
from ._transforms._scan import scan as scan
from ._transforms._vmap import vmap as vmap
from ._kinds import BatchStat as BatchStat
from ._kinds import Cache as Cache
from ._kinds import Intermediate as Intermediate
from ._kinds import Param as Param
from ._kinds import RngCount as RngCount
from ._kinds import RngKey as RngKey
from ._kinds import RngState as RngState
from ._variables import Variable as Variable
from . import nn as nn
from . import interop as interop

__version__ = "0.1.0"
