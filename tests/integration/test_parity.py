"""Training parity: the pipeline (real worker processes, real gRPC) reproduces single-process
PyTorch training, step by step."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from models import DeepMLP

from ravnest import parse_job, run_job
from ravnest.examples.digits import datasets
from ravnest.plan.building import set_seed

SEED = 7
BATCH = 32
STEPS = 20


def job(name: str, clusters: int, providers: int, optimizer: dict, microbatches: int,
        reduce_factor: int = 1):
    return parse_job({
        "apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob", "metadata": {"name": name},
        "spec": {
            "model": {"entrypoint": "models:deep_mlp",
                      "exampleInput": {"shape": [BATCH, 1, 8, 8]}},
            "data": {"entrypoint": "ravnest.examples.digits:datasets", "batchSize": BATCH,
                     "microbatches": microbatches, "seed": SEED},
            "training": {"epochs": 1, "optimizer": optimizer, "reduceFactor": reduce_factor,
                         "schedule": "sync", "validationFrequency": 1},
            "plan": {"clusters": clusters},
            "providers": [{"ram": 1, "bandwidth": 1000, "replicas": providers}],
            "checkpoint": {"everySteps": 0},
        },
    })


def reference_losses(optimizer: dict, clusters: int, steps: int):
    """Plain single-process training on the same batches: cluster c's block of global batch b
    is order[(b*K + c)*B : (b*K + c + 1)*B], so global batch b is order[b*K*B : (b+1)*K*B]."""
    train, _ = datasets()
    set_seed(SEED)
    model = DeepMLP()
    opt = getattr(torch.optim, optimizer["name"])(model.parameters(), **optimizer["params"])
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED + 0))
    x, y = train.tensors
    losses = []
    for b in range(steps):
        idx = order[b * clusters * BATCH:(b + 1) * clusters * BATCH]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def curve(out: Path, cluster: int):
    with open(out / "learning_curve.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["train_loss"] and int(r["cluster"]) == cluster]
    return [float(r["train_loss"]) for r in rows]


def test_three_stages_sync_equals_single_process(tmp_path, worker_env):
    opt = {"name": "Adam", "params": {"lr": 0.01}}
    run_job(job("parity-one", 1, 3, opt, microbatches=4), tmp_path, progress=False)
    got = curve(tmp_path, 0)[:STEPS]
    expected, _ = reference_losses(opt, 1, STEPS)
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


def test_two_clusters_averaging_every_step_equal_combined_batch(tmp_path, worker_env):
    opt = {"name": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    summary = run_job(job("parity-two", 2, 4, opt, microbatches=2), tmp_path, progress=False)
    c0, c1 = curve(tmp_path, 0), curve(tmp_path, 1)
    steps = summary["updates"]
    expected, model = reference_losses(opt, 2, steps)
    combined = [(a + b) / 2 for a, b in zip(c0, c1, strict=True)]
    torch.testing.assert_close(torch.tensor(combined), torch.tensor(expected), rtol=0, atol=1e-4)
    fused = torch.load(tmp_path / "model.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fused[k], v, rtol=0, atol=1e-4)
