"""Turn a validated job spec into live objects: model, datasets, criterion, optimizer, plan.

Every worker, the planner and the local runner build through these functions, so the model is
rebuilt identically (same seed, same entrypoint) wherever it is needed. Whatever user-supplied
code raises (at import, in a factory) and numbers too large to use become SpecErrors that name the
field. `preflight` builds once, before any worker starts, what would otherwise fail in every worker
(datasets, optimizer, a checkpoint folder that cannot be written) and plans no more clusters than
the training set can feed.
"""

from __future__ import annotations

import importlib
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ravnest.errors import PlanError, SpecError, shown
from ravnest.plan.costs import Workload
from ravnest.plan.handoff import identity
from ravnest.plan.partitioning import Profile, profile
from ravnest.plan.planning import make_plan
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.spec import Job, JobSpec
from ravnest.storing import Location, StorageError, is_durable, open_location


def set_seed(seed: int = 42) -> None:
    """Seed Python, NumPy and torch, as the seeds' `set_seed` does (42 unless given, its
    default)."""
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
    except Exception as e:  # the module's own code failed (RuntimeError, SyntaxError, ...)
        raise SpecError([f"{field}: importing module {module_name!r} failed: "
                         f"{_cause(e)}"]) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError([f"{field}: module {module_name!r} has no attribute {attr!r}"])
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError([f"{field}: {entrypoint!r} is not callable"])
    return obj  # type: ignore[no-any-return]


def build_model(spec: JobSpec) -> nn.Module:
    """The full model, initialised from the job's seed (identical in every process)."""
    check_numbers(spec)
    set_seed(spec.data.seed)
    if spec.model.torchscript is not None:
        try:
            return torch.jit.load(spec.model.torchscript, map_location="cpu")
        except (RuntimeError, ValueError, OSError) as e:
            raise SpecError([f"spec.model.torchscript: cannot load {spec.model.torchscript!r} "
                             f"({e})"]) from e
    assert spec.model.entrypoint is not None
    # e.g. a negative layer width (RuntimeError from nn.Linear) is the kwargs' fault
    model = _call("spec.model", spec.model.entrypoint, spec.model.kwargs,
                  blame_kwargs=bool(spec.model.kwargs))
    if not isinstance(model, nn.Module):
        raise SpecError([f"spec.model.entrypoint: {spec.model.entrypoint} returned "
                         f"{type(model).__name__}, not a torch.nn.Module"])
    return model


def _call(section: str, entrypoint: str, kwargs: dict[str, Any], blame_kwargs: bool) -> Any:
    """Call a job's `section` factory (`section.entrypoint` with `section.kwargs`); its failure
    becomes a SpecError naming the field: kwargs for a TypeError (or any error with
    `blame_kwargs`), else the entrypoint."""
    factory = resolve(entrypoint, f"{section}.entrypoint")
    try:
        return factory(**kwargs)
    except TypeError as e:
        call = f"{entrypoint}(**{shown(kwargs)})"
        raise SpecError([f"{section}.kwargs: {call} failed: TypeError: {e}; check "
                         "the kwargs' names and types"]) from e
    except Exception as e:
        field = f"{section}.kwargs" if blame_kwargs else f"{section}.entrypoint"
        raise SpecError([f"{field}: {entrypoint}(**kwargs) failed: {_cause(e)}"]) from e


def example_inputs(spec: JobSpec) -> tuple[torch.Tensor, ...]:
    """One random example batch of `spec.model.exampleInput` (seeded by `spec.data.seed`)."""
    check_numbers(spec)
    ex = spec.model.example_input
    gen = torch.Generator().manual_seed(spec.data.seed)
    dtype = getattr(torch, ex.dtype)
    if dtype.is_floating_point:
        return (torch.rand(ex.shape, generator=gen).to(dtype),)
    return (torch.randint(ex.high or 2, ex.shape, generator=gen, dtype=dtype),)


def build_datasets(spec: JobSpec) -> tuple[Any, Any]:
    out = _call("spec.data", spec.data.entrypoint, spec.data.kwargs, blame_kwargs=False)
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
    except (TypeError, ValueError, RuntimeError) as e:
        raise SpecError([f"spec.training.optimizer.params: {o.name} rejected them ({e})"]) from e


def build_scheduler(spec: JobSpec, optimizer: torch.optim.Optimizer) -> Any:
    s = spec.training.lr_scheduler
    if s is None:
        return None
    try:
        return getattr(torch.optim.lr_scheduler, s.name)(optimizer, **s.params)
    except (TypeError, ValueError) as e:
        raise SpecError([f"spec.training.lrScheduler.params: {s.name} rejected them ({e})"]) from e


def plan_job(job: Job, train_samples: int | None = None) -> tuple[Plan, Profile, Any]:
    """Build and profile the model, then plan it over the job's providers; with `train_samples`
    (the training set's size) no more clusters than the data can give a batch each."""
    return _plan_model(job.spec, build_model(job.spec), train_samples)


def preflight(job: Job, checkpoint_dir: str | Path | Location | None = None
              ) -> tuple[Plan, Profile, Any]:
    """`plan_job`, after building once what every worker would build and fail on alike.

    The datasets are built (their errors name spec.data.entrypoint) and their size bounds the
    clusters; the optimizer and scheduler are built on the model's parameters, the criterion
    constructed; with `checkpoint_dir`, a probe file is written there and deleted (errors name
    spec.checkpoint.path), last, so a job refused earlier writes nothing.
    """
    spec = job.spec
    check_numbers(spec)
    train, _ = build_datasets(spec)
    try:
        samples = len(train)
    except TypeError as e:
        raise SpecError([f"spec.data.entrypoint: {spec.data.entrypoint} must return datasets "
                         f"with a length, got a {type(train).__name__} ({e})"]) from e
    model = build_model(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    if params:
        build_scheduler(spec, build_optimizer(spec, params))
    build_criterion(spec)
    planned = _plan_model(spec, model, samples)
    if isinstance(checkpoint_dir, Location) and not checkpoint_dir.local:
        checkpoint_dir.probe("spec.checkpoint.path")
    elif checkpoint_dir is not None:
        local = checkpoint_dir.root if isinstance(checkpoint_dir, Location) else checkpoint_dir
        probe_writable(Path(local), "spec.checkpoint.path")
    return planned


def _plan_model(spec: JobSpec, model: nn.Module,
                train_samples: int | None) -> tuple[Plan, Profile, Any]:
    gm, prof = profile_example(spec, model)
    pool = [ProviderInfo(p.ram, p.bandwidth, p.compute) for p in spec.expanded_providers()]
    plan = make_plan(prof, pool, Workload.from_spec(spec), clusters=spec.plan.clusters,
                     max_clusters=spec.plan.max_clusters, identity=identity(spec),
                     train_samples=train_samples, spares=spec.plan.spares)
    return plan, prof, gm


EXAMPLE_INPUT_LIMIT = 2**30
"""Bytes an example input (`spec.model.exampleInput`) may take: it is only traced and profiled,
so a batch of a few samples will do (1 GiB)."""
INT64_MAX = 2**63 - 1
"""The largest count torch and a dataset's length can hold."""


def check_numbers(spec: JobSpec) -> None:
    """Refuse numbers too large to use, before they overflow in torch or the cost model."""
    ex = spec.model.example_input
    problems = [f"{field}: must be at most {bound} ({why}), got {shown(value)}"
                for field, value, bound, why in (
                    ("spec.data.seed", spec.data.seed, 2**64 - 1, "torch's largest seed"),
                    ("spec.data.batchSize", spec.data.batch_size, INT64_MAX, "2**63 - 1"),
                    ("spec.model.exampleInput.high", ex.high or 0, INT64_MAX, "2**63 - 1"),
                    ("spec.training.maxInFlight", spec.training.max_in_flight, INT64_MAX,
                     "2**63 - 1"),
                    ("spec.training.updateFrequency", spec.training.update_frequency, INT64_MAX,
                     "2**63 - 1"),
                    ("spec.training.reduceFactor", spec.training.reduce_factor, INT64_MAX,
                     "2**63 - 1"))
                if value > bound]
    if spec.data.seed < -(2**63):
        problems.append(f"spec.data.seed: must be at least -2**63 (torch's smallest seed), "
                        f"got {shown(spec.data.seed)}")
    size = math.prod(ex.shape) * getattr(torch, ex.dtype).itemsize
    if size > EXAMPLE_INPUT_LIMIT:
        shape = f"{shown(ex.shape)}" if max(ex.shape) <= INT64_MAX else "a dimension over 2**63"
        problems.append(f"spec.model.exampleInput.shape: {shape} of {ex.dtype} would take "
                        f"{_size(size)}, over the {_size(EXAMPLE_INPUT_LIMIT)} an example input "
                        "may take; it is only traced and profiled, so give a batch of a few "
                        "samples")
    if problems:
        raise SpecError(problems)


def probe_storage(spec: JobSpec, pvc_root: str) -> None:
    """Write and delete a file in each location of the job that outlives its pods (an object
    store or a claim: spec.checkpoint.path, spec.output.uri); a SpecError naming the field when
    one cannot be written (what a planner pod checks before any worker starts)."""
    for field, uri in (("spec.checkpoint.path", spec.checkpoint.path),
                       ("spec.output.uri", spec.output.uri)):
        if uri and is_durable(uri):
            try:
                where = open_location(uri, spec.storage.options(pvc_root))
            except StorageError as e:
                raise SpecError([f"{field}: {e}"]) from e
            where.probe(field)


def probe_writable(folder: Path, field: str) -> None:
    """Create `folder` if needed and write and delete a file there; a SpecError naming `field`
    if that fails (folders created by a failed probe are removed again)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    probe = folder / f".ravnest-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        for p in missing:
            try:
                p.rmdir()
            except OSError:
                continue
        raise SpecError([f"{field}: {str(folder)!r} is not writable ({e.strerror or e}); "
                         "give a folder this user can create and write"]) from e


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 2**100 else "more than 2**100 bytes"


def _cause(e: BaseException) -> str:
    """An exception from user code as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


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
