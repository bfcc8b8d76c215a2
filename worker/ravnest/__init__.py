"""Ravnest: decentralized training of PyTorch models over heterogeneous providers.

The public API: the job spec (`load_job`, `parse_job`), the planner (`plan_job`), the local runner
(`run_job`), and the seed API (`clusterize`, `Node`, `Trainer`, `set_seed`, `model_fusion`).
"""

from ._version import __version__
from .building import plan_job, set_seed
from .errors import PlanError, RavnestError, SpecError, TransportError, WorkerFailed
from .running import run_job
from .spec import Job, load_job, parse_job

__all__ = [
    "Job",
    "PlanError",
    "RavnestError",
    "SpecError",
    "TransportError",
    "WorkerFailed",
    "__version__",
    "load_job",
    "parse_job",
    "plan_job",
    "run_job",
    "set_seed",
]
