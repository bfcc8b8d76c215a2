"""The public API is what `ravnest/__init__.py` re-exports; changing it is a deliberate act.

Provider scripts written for Ravnest import `Node`, `Trainer`, `clusterize`, `set_seed` and
`model_fusion` from the package, and from Ravnest's own module paths, which stay.
"""

from __future__ import annotations

import ravnest

PUBLIC = {
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
}


def test_public_names_are_exactly_the_exported_ones() -> None:
    assert set(ravnest.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(ravnest, name) is not None, name


def test_public_names_are_defined_in_the_layered_subpackages() -> None:
    homes = {name: getattr(ravnest, name).__module__ for name in PUBLIC - {"__version__"}}
    assert homes["Node"] == "ravnest.seed.node"
    assert homes["Trainer"] == "ravnest.seed.trainer"
    assert homes["run_job"] == "ravnest.run.local"
    assert homes["plan_job"].startswith("ravnest.plan.")
    assert all(home.startswith("ravnest.") for home in homes.values()), homes


def test_ravnest_module_paths_of_the_seed_api_still_import() -> None:
    from ravnest.operations.utils import clusterize
    from ravnest.utils import model_fusion, set_seed

    assert clusterize is ravnest.clusterize
    assert model_fusion is ravnest.model_fusion
    assert set_seed is ravnest.set_seed


def test_set_seed_defaults_to_42_as_the_seeds() -> None:
    import random

    import numpy as np
    import torch

    ravnest.set_seed()
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ravnest.set_seed(42)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == drawn
    ravnest.set_seed(7)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) != drawn
