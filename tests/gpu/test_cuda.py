"""Training on a CUDA device, against the same training on the CPU and plain PyTorch: the
pipeline in one process, `ravnest run` of a job whose providers mix GPUs and CPUs, a checkpoint
written on a GPU resumed on CPUs, and a ring's state handed from a CPU node to one on the GPU."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from inprocess import check_against_single_process

from ravnest import parse_job, run_job
from ravnest.plan.partitioning import OUTPUT, build_stage, profile
from ravnest.train.devices import Placement
from ravnest.train.messages import parse
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.optimizing import Optimization
from ravnest.train.rejoining import pack_state, unpack_state
from ravnest.train.settings import Settings


@pytest.mark.parametrize("clusters", [1, 2])
def test_the_pipeline_on_the_device_equals_single_process_training_there(device, clusters):
    runtimes = check_against_single_process(clusters, Placement(torch.device(device)),
                                            atol=1e-4)
    assert {p.device.type for rt in runtimes for p in rt.stage.parameters()} == {
        torch.device(device).type}


def test_bf16_on_the_device_follows_single_process_training_under_the_same_autocast(device):
    check_against_single_process(2, Placement(torch.device(device), "bf16"), atol=5e-3)


def _logs(out, since: dict[str, int] | None = None) -> str:
    """The workers' logs (each from where `since` says it was)."""
    return "".join(p.read_text()[(since or {}).get(p.name, 0):]
                   for p in sorted((out / "logs").glob("node_*.log")))


def _lengths(out) -> dict[str, int]:
    return {p.name: len(p.read_text()) for p in (out / "logs").glob("node_*.log")}


def test_a_job_mixing_gpu_and_cpu_providers_trains_and_leaves_host_tensors(
        tmp_path, digits_doc, device, caplog):
    """Providers 0-2 on the GPU, 3-5 on CPUs, bf16: both clusters train to the example's usual
    accuracy and average with each other; the model files hold host tensors."""
    for p in digits_doc["spec"]["providers"][:3]:
        p["device"] = device
    digits_doc["spec"]["training"]["precision"] = "bf16"
    with caplog.at_level(logging.WARNING, logger="ravnest.run.local"):
        summary = run_job(parse_job(digits_doc), tmp_path, progress=False)
    assert summary["fused_val_metric"] >= 0.95, summary
    if device != "cpu":
        assert re.findall(r"(node_\d) trains its stage on cuda:0", _logs(tmp_path))
        assert "workers share cuda:0" in caplog.text
    for name in ("model.pt", "best_model.pt"):
        state = torch.load(tmp_path / name, weights_only=True)
        assert {t.device.type for t in state.values()} == {"cpu"}, name


def test_a_checkpoint_written_on_the_gpu_resumes_on_cpus(tmp_path, digits_doc, device):
    digits_doc["spec"]["checkpoint"] = {"everySteps": 11}
    digits_doc["spec"]["training"]["epochs"] = 2
    for p in digits_doc["spec"]["providers"]:
        p["device"] = device
    run_job(parse_job(digits_doc), tmp_path, progress=False)
    logged = _lengths(tmp_path)
    digits_doc["spec"]["training"]["epochs"] = 4
    for p in digits_doc["spec"]["providers"]:
        p["device"] = "cpu"
    summary = run_job(parse_job(digits_doc), tmp_path, progress=False)
    resumed = set(re.findall(r"resumed from checkpoint at step (\d+)", _logs(tmp_path, logged)))
    assert resumed == {"44"}, resumed
    assert summary["updates"] == 88 and summary["fused_val_metric"] >= 0.95, summary


def _mlp_node(device: str):
    torch.manual_seed(3)
    gm, prof = profile(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                           torch.nn.Linear(8, 3)), [torch.randn(4, 6)])
    stage = build_stage(gm, 0, len(prof.layers)).to(device)
    params = list(stage.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    metrics = WorkerMetrics(Identity("j", "", f"n-{device}", "root", 0, 0))
    return stage, Optimization(opt, None, params, Settings(), metrics)


def _step(stage, optimization, x, y) -> None:
    device = next(stage.parameters()).device
    out = stage(**{stage.input_names[0]: x.to(device)})[OUTPUT]
    torch.nn.functional.cross_entropy(out, y.to(device)).backward()
    optimization.step()


def test_a_node_on_the_device_rejoins_from_the_state_of_a_cpu_node(device):
    """Rejoin (and a hot spare's takeover, and a grown cluster's join) hands a ring's state over
    in frames: a CPU node's parameters and Adam state, loaded on the device, go on as the CPU
    node does."""
    sender, sent_opt = _mlp_node("cpu")
    joiner, join_opt = _mlp_node(device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))
               for _ in range(6)]
    for x, y in batches[:3]:
        _step(sender, sent_opt, x, y)
    names = tuple(sender.stage_state_dict())
    tensors, control = pack_state(sender, sent_opt, names)
    state = parse({"op": "state", "ring": "r", "round": 3, "updates": 3,
                   **json.loads(json.dumps(control))})
    unpack_state(joiner, join_opt, names, {k: v.clone() for k, v in tensors.items()}, state)
    for x, y in batches[3:]:
        _step(sender, sent_opt, x, y)
        _step(joiner, join_opt, x, y)
    a, b = sender.stage_state_dict(), joiner.stage_state_dict()
    for k in a:
        torch.testing.assert_close(b[k].cpu(), a[k], rtol=0, atol=1e-5, msg=k)
