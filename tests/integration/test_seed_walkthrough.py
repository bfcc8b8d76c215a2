"""The seeds' walkthrough: clusterize over node_configs.json, one provider script per node as its
own process, then model_fusion gives a state_dict the plain model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ravnest import clusterize, model_fusion, set_seed
from ravnest.examples.digits import build_model, datasets
from ravnest.run.local import free_ports

HERE = Path(__file__).parent
RAMS = [4, 8, 2, 16, 4, 8]


def test_walkthrough_six_providers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ports = free_ports(len(RAMS))
    Path("node_data").mkdir()
    Path("node_data/node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": r, "bandwidth": 100}}
        for i, (p, r) in enumerate(zip(ports, RAMS, strict=True))}))
    set_seed(42)
    plan = clusterize(model=build_model(), example_args=(torch.rand(32, 1, 8, 8),), clusters=2)
    assert len(plan.clusters) == 2 and len(plan.nodes) == 6
    assert sorted(p.name for p in Path("node_data/nodes").glob("node_*.json")) == \
        [f"node_{i}.json" for i in range(6)]

    procs = [subprocess.Popen([sys.executable, str(HERE / "seed_provider.py"), f"node_{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(6)]
    try:
        outputs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node_{i} failed:\n{out[-3000:]}"
    roots = [c.nodes[0] for c in plan.clusters]
    reported = [float(line.split()[1]) for i, out in enumerate(outputs)
                for line in out.splitlines() if line.startswith("accuracy")
                if f"node_{i}" in roots]
    assert len(reported) == 2 and min(reported) > 0.9

    fused = model_fusion(cluster_id=0)
    assert Path("trained/trained_state_dict.pt").exists()
    model = build_model()
    model.load_state_dict(torch.load("trained/trained_state_dict.pt", weights_only=True))
    assert sorted(fused) == sorted(model.state_dict())
    _, val = datasets()
    model.eval()
    with torch.no_grad():
        acc = (model(val.tensors[0]).argmax(1) == val.tensors[1]).float().mean().item()
    # the roots print 4 decimals; both clusters hold the same model after the final average
    assert abs(acc - reported[0]) < 1e-4 and abs(acc - reported[1]) < 1e-4
    # both clusters joined the final average: their fused models are the same
    other = model_fusion(cluster_id=1)
    for k in fused:
        torch.testing.assert_close(fused[k].float(), other[k].float(), rtol=0, atol=1e-6)
