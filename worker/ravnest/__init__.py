"""Ravnest: decentralized training of PyTorch models over heterogeneous providers.

The public API: the job spec (`load_job`, `parse_job`), the planner (`plan_job`), the local runner
(`run_job`), and the seed API (`clusterize`, `Node`, `Trainer`, `set_seed`, `model_fusion`).
"""

from ravnest._version import __version__
from ravnest.errors import PlanError, RavnestError, SpecError, TransportError, WorkerFailed
from ravnest.plan.building import plan_job, set_seed
from ravnest.run.local import run_job
from ravnest.seed.clustering import clusterize
from ravnest.seed.fusion import model_fusion
from ravnest.seed.node import Node
from ravnest.seed.trainer import Trainer
from ravnest.spec import Job, load_job, parse_job

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
