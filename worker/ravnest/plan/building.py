"""Turn a validated job spec into live objects: model, datasets, criterion, optimizer, plan.

Every worker, the planner and the local runner build through these functions, so the model is
rebuilt identically (same seed, same entrypoint) wherever it is needed. Import problems of
user-supplied entrypoints become SpecErrors that name the field.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ravnest.errors import PlanError, SpecError, shown
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import Profile, profile
from ravnest.plan.planning import make_plan
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.spec import Job, JobSpec


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch, as the seeds' `set_seed` does."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve(entrypoint: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:callable``; raise a SpecError naming `field` if that fails."""
    module_name, _, attr = entrypoint.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SpecError([f"{field}: cannot import module {module_name!r} ({e})"]) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError([f"{field}: module {module_name!r} has no attribute {attr!r}"])
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError([f"{field}: {entrypoint!r} is not callable"])
    return obj  # type: ignore[no-any-return]


def build_model(spec: JobSpec) -> nn.Module:
    """The full model, initialised from the job's seed (identical in every process)."""
    set_seed(spec.data.seed)
    if spec.model.torchscript is not None:
        try:
            return torch.jit.load(spec.model.torchscript, map_location="cpu")
        except (RuntimeError, ValueError, OSError) as e:
            raise SpecError([f"spec.model.torchscript: cannot load {spec.model.torchscript!r} "
                             f"({e})"]) from e
    assert spec.model.entrypoint is not None
    factory = resolve(spec.model.entrypoint, "spec.model.entrypoint")
    try:
        model = factory(**spec.model.kwargs)
    except TypeError as e:
        call = f"{spec.model.entrypoint}(**{shown(spec.model.kwargs)})"
        raise SpecError([f"spec.model.kwargs: {call} failed: TypeError: {e}; check "
                         "the kwargs' names and types"]) from e
    if not isinstance(model, nn.Module):
        raise SpecError([f"spec.model.entrypoint: {spec.model.entrypoint} returned "
                         f"{type(model).__name__}, not a torch.nn.Module"])
    return model


def example_inputs(spec: JobSpec) -> tuple[torch.Tensor, ...]:
    ex = spec.model.example_input
    gen = torch.Generator().manual_seed(spec.data.seed)
    dtype = getattr(torch, ex.dtype)
    if dtype.is_floating_point:
        return (torch.rand(ex.shape, generator=gen).to(dtype),)
    return (torch.randint(ex.high or 2, ex.shape, generator=gen, dtype=dtype),)


def build_datasets(spec: JobSpec) -> tuple[Any, Any]:
    factory = resolve(spec.data.entrypoint, "spec.data.entrypoint")
    try:
        out = factory(**spec.data.kwargs)
    except TypeError as e:
        call = f"{spec.data.entrypoint}(**{shown(spec.data.kwargs)})"
        raise SpecError([f"spec.data.kwargs: {call} failed: TypeError: {e}; check "
                         "the kwargs' names and types"]) from e
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise SpecError([f"spec.data.entrypoint: {spec.data.entrypoint} must return "
                         "(train_dataset, validation_dataset)"])
    return out[0], out[1]


def build_criterion(spec: JobSpec) -> Callable[..., torch.Tensor]:
    c = spec.training.criterion
    if ":" in c.name:
        return resolve(c.name, "spec.training.criterion.name")
    try:
        return getattr(nn, c.name)(**c.params)  # type: ignore[no-any-return]
    except TypeError as e:
        raise SpecError([f"spec.training.criterion.params: {c.name} rejected them ({e})"]) from e


def build_optimizer(spec: JobSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    o = spec.training.optimizer
    try:
        return getattr(torch.optim, o.name)(params, **o.params)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as e:
        raise SpecError([f"spec.training.optimizer.params: {o.name} rejected them ({e})"]) from e


def build_scheduler(spec: JobSpec, optimizer: torch.optim.Optimizer) -> Any:
    s = spec.training.lr_scheduler
    if s is None:
        return None
    try:
        return getattr(torch.optim.lr_scheduler, s.name)(optimizer, **s.params)
    except (TypeError, ValueError) as e:
        raise SpecError([f"spec.training.lrScheduler.params: {s.name} rejected them ({e})"]) from e


def plan_job(job: Job) -> tuple[Plan, Profile, Any]:
    """Build and profile the model, then plan it over the job's providers."""
    spec = job.spec
    model = build_model(spec)
    gm, prof = profile_example(spec, model)
    pool = [ProviderInfo(p.ram, p.bandwidth, p.compute) for p in spec.expanded_providers()]
    plan = make_plan(prof, pool, Workload.from_spec(spec), clusters=spec.plan.clusters,
                     max_clusters=spec.plan.max_clusters, identity=identity(spec))
    return plan, prof, gm


def profile_example(spec: JobSpec, model: nn.Module) -> tuple[nn.Module, Profile]:
    """`profile` on the job's example input; a model that fails on it is a SpecError naming
    spec.model.exampleInput (a shape or dtype the model does not take)."""
    try:
        return profile(model, example_inputs(spec))
    except PlanError as e:
        cause = e.__cause__
        if cause is None:  # the model ran, but cannot be split
            raise
        ex = spec.model.example_input
        first = (str(cause).strip().splitlines() or [""])[0]
        raise SpecError([f"spec.model.exampleInput: the model fails on an input of shape "
                         f"{shown(ex.shape)} and dtype {ex.dtype} ({type(cause).__name__}: "
                         f"{first}); give the shape and dtype of one batch it takes"]) from e


def identity(spec: JobSpec) -> dict[str, Any]:
    """What defines the model and its data, hashed into the plan fingerprint."""
    return {"model": spec.model.model_dump(mode="json"), "data": spec.data.model_dump(mode="json")}
