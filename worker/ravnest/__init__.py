"""Ravnest: decentralized training of PyTorch models over heterogeneous providers.

The public API: the job spec (`load_job`, `parse_job`), the planner (`plan_job`), the local runner
(`run_job`), and the seed API (`clusterize`, `Node`, `Trainer`, `set_seed`, `model_fusion`).

Names are imported when first used (PEP 562), so `ravnest validate` and `ravnest status`, which
need only the spec, do not load torch and grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ravnest._version import __version__
from ravnest.errors import PlanError, RavnestError, SpecError, TransportError, WorkerFailed

if TYPE_CHECKING:
    from ravnest.plan.building import plan_job, set_seed
    from ravnest.run.local import run_job
    from ravnest.seed.clustering import clusterize
    from ravnest.seed.fusion import model_fusion
    from ravnest.seed.node import Node
    from ravnest.seed.trainer import Trainer
    from ravnest.spec import Job, load_job, parse_job

_HOMES = {
    "Job": "ravnest.spec",
    "load_job": "ravnest.spec",
    "parse_job": "ravnest.spec",
    "plan_job": "ravnest.plan.building",
    "set_seed": "ravnest.plan.building",
    "run_job": "ravnest.run.local",
    "clusterize": "ravnest.seed.clustering",
    "model_fusion": "ravnest.seed.fusion",
    "Node": "ravnest.seed.node",
    "Trainer": "ravnest.seed.trainer",
}
"""Where each lazily imported public name is defined."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ravnest' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
