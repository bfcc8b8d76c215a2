"""Training on a CUDA device, against the same training on the CPU and plain PyTorch: the
pipeline in one process, `ravnest run` of a job whose providers mix GPUs and CPUs, a checkpoint
written on a GPU resumed on CPUs, and a ring's state handed from a CPU node to one on the GPU."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from handover import continue_as_sender, node
from inprocess import check_against_single_process

from ravnest import parse_job, run_job
from ravnest.train.devices import Placement


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


def test_a_node_on_the_device_rejoins_from_the_state_of_a_cpu_node(device):
    """Rejoin (and a hot spare's takeover, and a grown cluster's join) hands a ring's state over
    in frames: a CPU node's parameters and Adam state, loaded on the device, land beside its
    parameters and go on as the CPU node does."""
    # (tests/unit/test_rejoining.py: a bias before a batch norm has a gradient of ~0, and Adam
    # turns the devices' different rounding of it into steps of the learning rate's size)
    _, opt = continue_as_sender(node(2, device=device), atol=0.02)
    for p, st in opt.optimizer.state.items():
        assert st["exp_avg"].device == st["exp_avg_sq"].device == p.device


def test_frames_cross_to_and_from_the_device_through_pinned_memory_on_a_stream_of_their_own(
        device):
    """A CUDA stage's frames: received into the transport's pinned buffers, copied to the device
    on the mover's stream (not the compute stream, which waits for it on the device), and sent
    from pinned host copies that the sender waits for (`ready`), the loss read only then."""
    from ravnest.comm.buffers import BufferPool
    from ravnest.comm.transport import Credentials, Server

    place = Placement(torch.device(device))
    if device == "cpu":  # (a dry run: nothing is moved on the CPU)
        assert place.mover is None
        return
    assert place.mover is not None
    assert place.mover.stream != torch.cuda.current_stream(place.device)
    server = Server("127.0.0.1:0", Credentials("t", "f"), lambda frame: None, pinned=True)
    try:
        assert server.buffers.take(2 << 20).is_pinned()
    finally:
        server.stop(grace=0)
    pool = BufferPool(min_bytes=1, pinned=True)
    x = pool.take(4096 * 4).view(torch.float32)
    x.copy_(torch.arange(4096, dtype=torch.float32))
    assert x.is_pinned()
    moved = place.put({"x": x, "labels": torch.arange(3)})  # (labels: not pinned yet)
    y = moved["x"] * 2
    assert y.device.type == "cuda" and moved["labels"].device.type == "cuda"
    tensors, control, ready = place.outgoing({"y": y}, {"n": 3, "loss": y.mean()})
    assert ready is not None and tensors["y"].is_pinned()
    ready()
    assert torch.equal(tensors["y"], torch.arange(4096, dtype=torch.float32) * 2)
    assert control == {"n": 3, "loss": pytest.approx(4095.0)}
    assert torch.equal(moved["labels"].cpu(), torch.arange(3))
