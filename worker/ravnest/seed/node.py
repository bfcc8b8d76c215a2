"""The seed API's `Node`: one provider, set up from the metadata `clusterize` wrote.

A provider script names its node (``Node(name='node_3', ...)``) and passes its optimizer, loss and
loaders; the role (root, stem, leaf) follows from the plan. The node starts its gRPC server at once
so that its neighbours can reach it; `Trainer.train()` then runs the same runtime the workers of a
RavnestJob run.

As in Ravnest, a leaf reads its own `labels` (and `test_labels`) in step with its root's
train_loader (and val_loader): the criterion receives each batch they yield, whole
(``loss_fn(preds, targets)`` with ``targets[1]`` for a loader of ``(X, y)`` pairs); the root
sends its inputs only. `reduce_factor=None` averages once per epoch. `outer` gives the rings an
outer optimizer (DiLoCo), as a job's `training.outer` does: True for its defaults, or a dict such
as ``{"optimizer": "nesterov", "lr": 0.7, "momentum": 0.9}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan.partitioning import Stage, profile
from ravnest.run.assembling import connect, cut_stage
from ravnest.run.metadata import TOKEN_ENV, NodeMetadata, host_of, with_host
from ravnest.seed.arguments import Arguments
from ravnest.seed.console import say
from ravnest.spec import TrainingSpec, parse_section
from ravnest.train import devices, heap
from ravnest.train.metrics import Identity, WorkerMetrics


class Node:
    """A provider node (Ravnest's `ravnest.node.Node`)."""

    def __init__(self, name: str | None = None, model: nn.Module | None = None,
                 optimizer: type[torch.optim.Optimizer] | None = None,
                 optimizer_params: dict[str, Any] | None = None, lr_scheduler: Any = None,
                 lr_scheduler_params: dict[str, Any] | None = None,
                 lr_step_on_epoch_change: bool = True,
                 criterion: Callable[..., torch.Tensor] | None = None, update_frequency: int = 1,
                 reduce_factor: int | None = None, labels: Any = None, test_labels: Any = None,
                 device: torch.device | str = "cpu", loss_filename: str = "losses.txt",
                 compression: bool | str = False, average_optim: bool = False,
                 outer: bool | dict[str, Any] | None = None,
                 node_data: str | Path = "node_data", token: str | None = None,
                 example_args: tuple[torch.Tensor, ...] = (), **kwargs: Any) -> None:
        if not isinstance(name, str) or not name.startswith("node_") or not name[5:].isdigit():
            raise SpecError([f"name: must look like 'node_0', 'node_17', got {name!r}"])
        _check_arguments(name, locals())
        self.device = devices.resolve(device, f"Node({name!r}, device={str(device)!r})")
        root = Path(node_data)
        self.meta = _metadata(root, name, kwargs.get("listen_host"))
        self.name = name
        self.plan = self.meta.plan
        self.me = self.plan.node(name)
        _check_leaf(self.me, criterion, labels)
        self.addresses: dict[str, str] = self.meta.addresses
        self.microbatches = self.meta.microbatches or 1
        self.stage = self._stage(root, model, example_args).to(self.device)
        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt_cls = optimizer or torch.optim.Adam
        self.optimizer = opt_cls(params, **(optimizer_params or {})) if params else None
        self.lr_scheduler = (lr_scheduler(self.optimizer, **(lr_scheduler_params or {}))
                             if lr_scheduler is not None and self.optimizer is not None else None)
        self.lr_step_on_epoch_change = lr_step_on_epoch_change
        self.criterion = criterion
        self.labels, self.test_labels = labels, test_labels
        self.reduce_each_epoch = reduce_factor is None
        self.loss_filename = loss_filename
        wire = compression if isinstance(compression, str) else ("bf16" if compression else "none")
        # the training options given here, validated as a job's are; `Trainer` adds its own
        self.training = parse_section(TrainingSpec, {
            "update_frequency": update_frequency, "reduce_factor": reduce_factor or 2**62,
            "average_optimizer": average_optim, "compression": wire,
            **({"outer": {} if outer is True else outer} if outer not in (None, False) else {})})
        self.token = token or os.environ.get(TOKEN_ENV) or _read_token(root)
        heap.tune(os.environ)  # this process is the provider's worker, as `ravnest worker` is
        _share_cpus(self.meta, name)
        self.metrics = WorkerMetrics(Identity("seed", "local", name, self.me.role,
                                              self.me.cluster, self.me.stage))
        t = self.training
        self.wiring = connect(self.meta, self.token, self.metrics,
                              tls=self.meta.tls_dir is not None,
                              tcp_ring=self.meta.ring_addresses is not None,
                              compression=t.compression, reduce_timeout=t.reduce_timeout_seconds,
                              inbox_capacity=256)
        self.wiring.start()

    def _stage(self, root: Path, model: nn.Module | None,
               example_args: tuple[torch.Tensor, ...]) -> Stage:
        if model is None:
            path = root / "nodes" / f"{self.name}.submodel.pt"
            # A file clusterize() wrote on this machine for this provider: trusted, local.
            stage = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(stage, Stage):
                raise PlanError(f"{path}: not a ravnest stage")
            return stage
        if not example_args:
            raise PlanError("Node(model=...): also pass example_args to split the model")
        gm, prof = profile(model, list(example_args))
        return cut_stage(gm, prof, self.plan, self.name, "pass the model given to clusterize()")

    def close(self) -> None:
        self.wiring.close()


def _check_arguments(name: str, a: dict[str, Any]) -> None:
    """Node's arguments (`a`: its locals on entry) checked as a job file's fields are
    (`seed.arguments`): a SpecError names each wrong one."""
    given = Arguments(f"Node({name!r})")
    given.model("model", a["model"], optional=True)
    given.optimizer_class("optimizer", a["optimizer"])
    given.mapping("optimizer_params", a["optimizer_params"])
    given.scheduler("lr_scheduler", a["lr_scheduler"])
    given.mapping("lr_scheduler_params", a["lr_scheduler_params"])
    given.flag("lr_step_on_epoch_change", a["lr_step_on_epoch_change"])
    given.function("criterion", a["criterion"],
                   "a loss function such as torch.nn.functional.cross_entropy or "
                   "torch.nn.CrossEntropyLoss(), or None")
    given.whole("update_frequency", a["update_frequency"])
    given.whole("reduce_factor", a["reduce_factor"], optional=True)
    given.loader("labels", a["labels"])
    given.loader("test_labels", a["test_labels"])
    given.path("loss_filename", a["loss_filename"])
    if not isinstance(a["compression"], bool | str):
        given.bad("compression", a["compression"], "True, False or a wire format ('bf16', "
                  "'fp16', or 'int8' with outer)")
    given.flag("average_optim", a["average_optim"])
    if not isinstance(a["outer"], bool | dict | None):
        given.bad("outer", a["outer"], "True, None or a dict of training.outer's fields "
                  "(optimizer, lr, momentum)")
    given.path("node_data", a["node_data"])
    given.text("token", a["token"], optional=True)
    given.inputs("example_args", a["example_args"], optional=True)
    given.check()


def _share_cpus(meta: NodeMetadata, name: str) -> None:
    """Providers configured on one host share its CPUs: each takes its share of torch's threads
    (as `ravnest run` gives its workers), unless OMP_NUM_THREADS says otherwise. Three
    providers with two threads each on a two-core machine train several times slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    host = host_of(meta.addresses[name])
    here = sum(1 for a in meta.addresses.values() if host_of(a) == host)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if here > 1:
        threads = max(1, (cpus or 1) // here)
        if threads < torch.get_num_threads():
            torch.set_num_threads(threads)
            say(f"{name}: {here} providers share {host}: {threads} torch thread(s) each")


def _check_leaf(me: Any, criterion: Any, labels: Any) -> None:
    """A leaf needs the criterion and, unless it is its cluster's root too, its labels."""
    if not me.is_leaf:
        return
    if criterion is None:
        raise SpecError([f"criterion: {me.name} is cluster {me.cluster}'s leaf: pass "
                         f"criterion=loss_fn (called as loss_fn(outputs, targets))"])
    if labels is None and not me.is_root:
        raise SpecError([f"labels: {me.name} is cluster {me.cluster}'s leaf: pass labels=, the "
                         f"DataLoader (or tensor) whose batches the criterion receives as "
                         f"targets, in the order of the root's train_loader"])


def _metadata(root: Path, name: str, listen_host: str | None) -> NodeMetadata:
    """This node's metadata as clusterize() wrote it, listening on `listen_host` if given."""
    path = root / "nodes" / f"{name}.json"
    if not path.exists():
        raise SpecError([f"{path}: no node metadata; run clusterize() first"])
    try:
        meta = NodeMetadata.load(path)
    except SpecError as e:
        raise SpecError([*e.problems, "run clusterize() again to write it"]) from e
    # (its identity is where clusterize() wrote it, wherever node_data is now)
    meta = replace(meta, identity_file=str(root / "identity" / f"{name}.json"))
    if not listen_host:
        return meta
    return replace(meta, listen=with_host(meta.listen, listen_host),
                   ring_listen=with_host(meta.ring_listen, listen_host))


def _read_token(root: Path) -> str:
    try:
        return (root / "token").read_text().strip()
    except OSError as e:
        raise RavnestError(f"no job token: {root / 'token'} missing and {TOKEN_ENV} unset") from e
