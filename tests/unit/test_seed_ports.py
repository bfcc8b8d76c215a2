"""The seed API's providers listen only where `node_configs.json` says, unless asked for the ring
data plane; then a ring port that is another provider's address is refused before anything is
written (Ravnest's local examples give providers consecutive ports on one host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ravnest import clusterize
from ravnest.errors import SpecError
from ravnest.examples.digits import build_model
from ravnest.run.metadata import NodeMetadata


def _configs(folder: Path, ports: list[int]) -> Path:
    node_data = folder / "node_data"
    node_data.mkdir()
    (node_data / "node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": 4, "bandwidth": 100}}
        for i, p in enumerate(ports)}))
    return node_data


def _clusterize(node_data: Path, **kwargs: object) -> None:
    clusterize(model=build_model(), example_args=(torch.rand(16, 1, 8, 8),), clusters=1,
               node_data=node_data, **kwargs)  # type: ignore[arg-type]


def test_by_default_a_provider_needs_only_its_configured_address(tmp_path: Path) -> None:
    node_data = _configs(tmp_path, [8080, 8081, 8082])
    _clusterize(node_data)
    for i, port in enumerate([8080, 8081, 8082]):
        meta = NodeMetadata.load(node_data / "nodes" / f"node_{i}.json")
        assert meta.ring_addresses is None
        assert meta.listen.endswith(f":{port}")


def test_ring_data_plane_on_consecutive_ports_is_refused(tmp_path: Path) -> None:
    node_data = _configs(tmp_path, [8080, 8081, 8082])
    with pytest.raises(SpecError) as e:
        _clusterize(node_data, ring_transport="tcp")
    assert "node_0's ring port 127.0.0.1:8081 is node_1's address" in str(e.value)
    assert not (node_data / "nodes").exists()


def test_ring_data_plane_with_spaced_ports(tmp_path: Path) -> None:
    node_data = _configs(tmp_path, [8080, 8090, 8100])
    _clusterize(node_data, ring_transport="tcp")
    meta = NodeMetadata.load(node_data / "nodes" / "node_1.json")
    assert meta.ring_addresses == {"node_0": "127.0.0.1:8081", "node_1": "127.0.0.1:8091",
                                   "node_2": "127.0.0.1:8101"}


def test_free_port_pairs_leave_room_for_each_ring_server() -> None:
    """Tests and local runs pick seed ports with free_ports(n, span=2): the port above each one was
    free too, and no pair overlaps another (a ring server once failed to bind port+1 because an
    outgoing connection held it)."""
    import socket

    from ravnest.run.local import free_ports

    ports = free_ports(8, span=2)
    taken = [p + k for p in ports for k in (0, 1)]
    assert len(set(taken)) == 16
    socks = []
    try:
        for port in taken:  # each one still bindable, all at once
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_free_ports_are_below_the_ports_the_kernel_hands_out_itself() -> None:
    """Ports for a local run's workers come from below the ephemeral range, which outgoing
    connections and binds to port 0 take theirs from: between the pick and the worker's bind,
    no connection of a program running beside can take one."""
    from pathlib import Path

    from ravnest.run.local import free_ports

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(20, span=2)
    assert len(set(ports)) == 20 and all(10000 <= p and p + 1 < low for p in ports), (low, ports)
