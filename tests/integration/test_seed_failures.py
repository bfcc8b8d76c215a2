"""The seed API when a provider fails, each provider its own process (Ravnest's way): a port in
use stops `Node()` at once, a provider listens on its configured address, and a provider that
raises or is killed stops its whole cluster within seconds, every survivor naming it (before,
they waited out the 300 s peer timeout)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ravnest import clusterize, set_seed
from ravnest.examples.digits import build_model
from ravnest.run.local import free_ports
from ravnest.run.metadata import NodeMetadata

SCRIPT = Path(__file__).parent / "upstream" / "failing_provider.py"
STOPS_WITHIN = 60.0
"""Generous: the cluster must stop in seconds, far below the 300 s peer timeout."""


def _clusterize(folder: Path, n: int = 3) -> tuple[list[str], list[str]]:
    """node_configs.json for `n` equal providers on 127.0.0.1, clusterized by default; returns
    the addresses by node id and the cluster's chain (root, stem, leaf)."""
    ports = free_ports(n)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    (folder / "node_data").mkdir()
    (folder / "node_data/node_configs.json").write_text(json.dumps({
        str(i): {"IP": a, "benchmarks": {"ram": 8, "bandwidth": 100}}
        for i, a in enumerate(addresses)}))
    set_seed(42)
    plan = clusterize(model=build_model(), example_args=(torch.rand(32, 1, 8, 8),),
                      node_data=folder / "node_data")
    assert len(plan.clusters) == 1 and len(plan.clusters[0].nodes) == 3
    return addresses, list(plan.clusters[0].nodes)


def _start(folder: Path, node: str, epochs: int, failing: str = "-",
           fail_at: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), node, str(epochs), failing, str(fail_at)], cwd=folder,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _kill_all(procs: dict[str, subprocess.Popen[str]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        if p.stdout is not None:
            p.stdout.close()


def _finish(procs: dict[str, subprocess.Popen[str]], deadline: float) -> dict[str, str]:
    """Each process's whole output once it exits, all by `deadline` (time.monotonic())."""
    outputs = {}
    for name, p in procs.items():
        try:
            outputs[name] = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0]
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{name} still runs {STOPS_WITHIN} s after the failure") from e
    return outputs


def test_a_port_in_use_stops_node_at_once(tmp_path: Path) -> None:
    addresses, chain = _clusterize(tmp_path)
    node = chain[1]
    host, port = addresses[int(node.removeprefix("node_"))].rsplit(":", 1)
    with socket.socket() as held:
        held.bind((host, int(port)))
        held.listen()
        started = time.monotonic()
        proc = _start(tmp_path, node, epochs=1)
        try:
            out = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        took = time.monotonic() - started
    assert proc.returncode != 0, out
    assert f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out, out[-3000:]
    assert f"{node}: started" not in out
    assert took < STOPS_WITHIN, f"Node() took {took:.0f} s to fail"


def test_clusterize_listens_on_the_configured_address(tmp_path: Path) -> None:
    addresses, _ = _clusterize(tmp_path)
    for i, address in enumerate(addresses):
        meta = NodeMetadata.load(tmp_path / "node_data" / "nodes" / f"node_{i}.json")
        assert meta.listen == address and not meta.listen.startswith("0.0.0.0")
        assert meta.addresses[f"node_{i}"] == address


def test_a_provider_that_raises_stops_its_cluster_naming_it(tmp_path: Path) -> None:
    _, chain = _clusterize(tmp_path)
    root, stem, leaf = chain
    procs = {n: _start(tmp_path, n, epochs=50, failing=leaf, fail_at=3) for n in chain}
    try:
        # the leaf fails a few batches in (startup takes seconds); the others follow it
        outputs = _finish({leaf: procs[leaf]}, time.monotonic() + 180)
        outputs |= _finish({root: procs[root], stem: procs[stem]},
                           time.monotonic() + STOPS_WITHIN)
    finally:
        _kill_all(procs)
    for n, p in procs.items():
        assert p.returncode != 0, f"{n} exited 0:\n{outputs[n][-3000:]}"
        assert f"{n}: finished" not in outputs[n]
    assert "ValueError: boom" in outputs[leaf], outputs[leaf][-3000:]
    for n in (root, stem):
        assert f"{leaf} failed: ValueError: boom" in outputs[n], f"{n}:\n{outputs[n][-3000:]}"
    # it failed at the third criterion call: the root never finished an epoch
    assert "Epoch 1/" not in outputs[root]


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The lines of `proc`'s output as they come (None at its end)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_killed_provider_stops_its_cluster_naming_it(tmp_path: Path) -> None:
    _, chain = _clusterize(tmp_path)
    root, stem, leaf = chain
    procs = {n: _start(tmp_path, n, epochs=1000) for n in chain}
    try:
        root_lines = _lines(procs[root])
        seen: list[str] = []
        while True:
            line = root_lines.get(timeout=300)
            assert line is not None, "the root ended before its first epoch:\n" + "".join(seen)
            seen.append(line)
            if line.startswith("Epoch 1/"):
                break
        os.kill(procs[stem].pid, signal.SIGKILL)
        killed = time.monotonic()
        leaf_out = _finish({leaf: procs[leaf]}, killed + STOPS_WITHIN)[leaf]
        rest: list[str] = []
        while (line := root_lines.get(timeout=max(killed + STOPS_WITHIN - time.monotonic(),
                                                  0.1))) is not None:
            rest.append(line)
        procs[root].wait(timeout=max(killed + STOPS_WITHIN - time.monotonic(), 0.1))
        root_out = "".join(seen + rest)
    finally:
        _kill_all(procs)
    assert procs[stem].returncode == -signal.SIGKILL
    for n, out in ((root, root_out), (leaf, leaf_out)):
        assert procs[n].returncode != 0, f"{n} exited 0:\n{out[-3000:]}"
        assert f"{stem} failed: it was lost: no answer from" in out, f"{n}:\n{out[-3000:]}"
        assert f"{n}: finished" not in out
    assert "Epoch 1000/1000" not in root_out
