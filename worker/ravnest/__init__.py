"""Ravnest: decentralized training of PyTorch models over heterogeneous providers.

The public API: the job spec (`load_job`, `parse_job`), the planner (`plan_job`), the local runner
(`run_job`), and the seed API (`clusterize`, `Node`, `Trainer`, `set_seed`, `model_fusion`).
"""

from ._version import __version__
from .building import plan_job, set_seed
from .clustering import clusterize
from .errors import PlanError, RavnestError, SpecError, TransportError, WorkerFailed
from .node import Node
from .running import run_job
from .spec import Job, load_job, parse_job
from .trainer import Trainer
from .utils import model_fusion

__all__ = [
    "Job",
    "Node",
    "PlanError",
    "RavnestError",
    "SpecError",
    "Trainer",
    "TransportError",
    "WorkerFailed",
    "__version__",
    "clusterize",
    "load_job",
    "model_fusion",
    "parse_job",
    "plan_job",
    "run_job",
    "set_seed",
]
