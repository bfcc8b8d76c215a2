"""The seeds' walkthrough: clusterize over node_configs.json, one provider script per node as its
own process, then model_fusion gives a state_dict the plain model loads."""

from __future__ import annotations

from pathlib import Path

import torch
from seed_processes import run_providers, write_node_configs

from ravnest import clusterize, model_fusion, set_seed
from ravnest.examples.digits import build_model, datasets

HERE = Path(__file__).parent
RAMS = [4, 8, 2, 16, 4, 8]


def test_walkthrough_six_providers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_node_configs(tmp_path, RAMS)
    set_seed(42)
    plan = clusterize(model=build_model(), example_args=(torch.rand(32, 1, 8, 8),), clusters=2)
    assert len(plan.clusters) == 2 and len(plan.nodes) == 6
    assert sorted(p.name for p in Path("node_data/nodes").glob("node_*.json")) == \
        [f"node_{i}.json" for i in range(6)]

    outputs = run_providers(tmp_path, HERE / "seed_provider.py", len(RAMS), timeout=400)
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
