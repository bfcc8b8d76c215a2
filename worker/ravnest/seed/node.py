"""The seed API's `Node`: one provider, set up from the metadata `clusterize` wrote.

A provider script names its node (``Node(name='node_3', ...)``) and passes its optimizer, loss and
loaders; the role (root, stem, leaf) follows from the plan. The node starts its gRPC server at once
so that its neighbours can reach it; `Trainer.train()` then runs the same runtime the workers of a
RavnestJob run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan.partitioning import Stage, build_stage, profile
from ravnest.plan.plans import Plan
from ravnest.train import heap
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
                 node_data: str | Path = "node_data", token: str | None = None,
                 example_args: tuple[torch.Tensor, ...] = (), **kwargs: Any) -> None:
        if not name or not name.startswith("node_") or not name[5:].isdigit():
            raise SpecError([f"name: must look like 'node_0', 'node_17', got {name!r}"])
        if torch.device(device).type != "cpu":
            raise RavnestError(f"device {device!r}: this build trains on the CPU only")
        root = Path(node_data)
        meta_path = root / "nodes" / f"{name}.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise SpecError([f"{meta_path}: no node metadata; run clusterize() first ({e})"]) from e
        self.name = name
        self.plan = Plan.from_dict(meta["plan"])
        self.me = self.plan.node(name)
        self.addresses: dict[str, str] = meta["addresses"]
        self.microbatches = int(meta.get("microbatches", 1))
        self.stage = self._stage(root, model, example_args)
        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt_cls = optimizer or torch.optim.Adam
        self.optimizer = opt_cls(params, **(optimizer_params or {})) if params else None
        self.lr_scheduler = (lr_scheduler(self.optimizer, **(lr_scheduler_params or {}))
                             if lr_scheduler is not None and self.optimizer is not None else None)
        self.lr_step_on_epoch_change = lr_step_on_epoch_change
        self.criterion = criterion
        self.update_frequency = update_frequency
        self.reduce_factor = reduce_factor
        self.labels, self.test_labels = labels, test_labels
        self.loss_filename = loss_filename
        self.compression = compression if isinstance(compression, str) else (
            "bf16" if compression else "none")
        self.average_optim = average_optim
        self.token = token or os.environ.get("RAVNEST_TOKEN") or _read_token(root)
        heap.tune(os.environ)  # this process is the provider's worker, as `ravnest worker` is
        self.metrics = WorkerMetrics(Identity("seed", "local", name, self.me.role,
                                              self.me.cluster, self.me.stage))
        creds = Credentials(self.token, self.plan.fingerprint)
        self.inbox = Inbox(capacity=256)
        port = self.addresses[name].rsplit(":", 1)[1]
        self.server = Server(f"{kwargs.get('listen_host', '0.0.0.0')}:{port}", creds,
                             self.inbox.deliver, on_bytes=self.metrics.received)
        up, down = self.plan.neighbours(name)
        wanted = {n for n in (up, down) if n} | {m for r in self.plan.rings_of(name)
                                                 for m in r.members if m != name}
        self.peers = {n: Peer(self.addresses[n], creds, self.compression,
                              on_bytes=self.metrics.sent) for n in sorted(wanted)}
        self.server.start()

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
        me = self.me
        if prof.layers[me.start].name != me.first_layer or \
                prof.layers[me.end - 1].name != me.last_layer:
            raise PlanError(f"{self.name}: the model does not match the plan from clusterize()")
        return build_stage(gm, me.start, me.end)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.server.stop()


def _read_token(root: Path) -> str:
    try:
        return (root / "token").read_text().strip()
    except OSError as e:
        raise RavnestError(f"no job token: {root / 'token'} missing and RAVNEST_TOKEN unset") from e
