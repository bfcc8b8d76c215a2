"""The seed API is assembled as a worker is: with `clusterize(tls=True)` its providers talk mutual
TLS with certificates of a CA made for the plan, and with `ring_transport="tcp"` ring pieces go on
the ring data plane, one port above each provider's gRPC port (the seed API's default is gRPC: one
port per provider, as in Ravnest). The trained model is the same as with
the ring over gRPC and no TLS (providers in threads of one process: a model without dropout, whose
random draws would interleave)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ravnest import Node, Trainer, clusterize, model_fusion, set_seed
from ravnest.comm.dataplane import RingLink
from ravnest.comm.tls import TlsMaterial
from ravnest.examples.digits import build_model, datasets
from ravnest.run.local import free_ports
from ravnest.run.metadata import ring_address


def _train(folder: Path, ring_transport: str, tls: bool) -> tuple[dict[str, torch.Tensor],
                                                                   list[Node]]:
    node_data = folder / "node_data"
    node_data.mkdir(parents=True)
    ports = free_ports(4, span=2)  # each ring data plane listens one port above its provider
    (node_data / "node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": 4, "bandwidth": 100}}
        for i, p in enumerate(ports)}))
    set_seed(42)
    plan = clusterize(model=build_model(dropout=0.0), example_args=(torch.rand(32, 1, 8, 8),),
                      clusters=2, node_data=node_data, ring_transport=ring_transport, tls=tls)
    assert len(plan.clusters) == 2 and len(plan.nodes) == 4 and plan.rings
    train, val = datasets()
    nodes = [Node(name=n, optimizer=torch.optim.Adam, optimizer_params={"lr": 0.003},
                  criterion=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
                  labels=DataLoader(train, batch_size=32, drop_last=True),
                  test_labels=DataLoader(val, batch_size=64), reduce_factor=1,
                  listen_host="127.0.0.1", node_data=node_data,
                  loss_filename=str(folder / f"{n}.losses.txt")) for n in plan.names()]
    trainers = [Trainer(node=node, train_loader=DataLoader(train, batch_size=32, drop_last=True),
                        val_loader=DataLoader(val, batch_size=64), epochs=1, batch_size=32,
                        save=True, save_dir=folder / "trained") for node in nodes]
    errors: list[BaseException] = []

    def train(trainer: Trainer) -> None:
        try:
            trainer.train()
        except BaseException as e:  # reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return model_fusion(cluster_id=0, trained_dir=folder / "trained"), nodes


def test_seed_providers_train_over_tls_and_the_ring_data_plane(tmp_path) -> None:
    secured, nodes = _train(tmp_path / "tcp", "tcp", tls=True)
    for node in nodes:
        assert node.meta.tls_dir is not None
        TlsMaterial.load(node.meta.tls_dir)
        assert node.wiring.ring_server is not None
        assert node.wiring.ring_server.port == int(ring_address(node.addresses[node.name])
                                                   .rsplit(":", 1)[1])
        assert node.wiring.ring_links
        for successor, link in node.wiring.ring_links.items():
            assert isinstance(link, RingLink)
            assert link.address == ring_address(node.addresses[successor])
    plain, nodes = _train(tmp_path / "grpc", "grpc", tls=False)
    assert all(n.meta.tls_dir is None and n.wiring.ring_server is None for n in nodes)
    assert secured.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(value, secured[name]), name
