"""Running seed-API providers the way their users do: a node_configs.json of providers on
127.0.0.1, and one process per provider running a provider script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ravnest.run.local import free_ports


def write_node_configs(folder: Path, rams: Sequence[float], bandwidth: float = 100) -> None:
    """`folder/node_data/node_configs.json`: one provider per RAM (GB) on a free local port."""
    (folder / "node_data").mkdir(parents=True, exist_ok=True)
    (folder / "node_data/node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": r, "bandwidth": bandwidth}}
        for i, (p, r) in enumerate(zip(free_ports(len(rams)), rams, strict=True))}))


def run_providers(folder: Path, script: Path, n: int, *args: str, threads: int | None = None,
                  timeout: float = 600) -> list[str]:
    """Run `script node_<i> *args` for each of `n` providers in `folder`, each its own process;
    assert they all exit 0 and return their outputs. `threads`: OMP_NUM_THREADS for each."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    procs = [subprocess.Popen([sys.executable, str(script), f"node_{i}", *args], cwd=folder,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for i in range(n)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node_{i} failed:\n{out[-4000:]}"
    return outputs
