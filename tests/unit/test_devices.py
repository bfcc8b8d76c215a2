"""Where a provider's stage trains: its device as a job names it, and what happens where torch
cannot train there (this machine has no CUDA device; tests/gpu runs where one is)."""

from __future__ import annotations

import pytest
import torch

from ravnest import parse_job
from ravnest.errors import RavnestError, SpecError
from ravnest.run.local import LocalRun
from ravnest.train import devices
from ravnest.train.devices import Placement
from ravnest.train.scaling import LossScale, unscale

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="what a machine without CUDA does (tests/gpu has CUDA)")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "CUDA", "cuda:-1", "mps", ""])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_with_its_path(digits_doc, device):
    digits_doc["spec"]["providers"][2]["device"] = device
    with pytest.raises(SpecError, match=r"spec\.providers\[2\]\.device: must be cpu, cuda or "
                                        r"cuda:N"):
        parse_job(digits_doc)


def test_cpu_cuda_and_an_index_are_devices(digits_doc):
    for i, device in enumerate(["cpu", "cuda", "cuda:3"]):
        digits_doc["spec"]["providers"][i]["device"] = device
    job = parse_job(digits_doc)
    assert [p.device for p in job.spec.providers[:4]] == ["cpu", "cuda", "cuda:3", "cpu"]


@needs_no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_torch_cannot_see_is_an_error_naming_who_and_what_torch_says(device):
    with pytest.raises(RavnestError) as e:
        devices.resolve(device, "node_3 (provider 2)")
    said = str(e.value)
    assert said.startswith(f"node_3 (provider 2): device '{device}', but torch ")
    assert torch.__version__ in said
    assert ("built without CUDA" in said) == (torch.version.cuda is None)


def test_an_index_past_the_devices_torch_sees_is_an_error():
    with pytest.raises(RavnestError, match=r"^p: device 'cuda:\d+', but torch"):
        devices.resolve(f"cuda:{torch.cuda.device_count()}", "p")
    assert devices.resolve("cpu", "p") == torch.device("cpu")


@needs_no_cuda
def test_ravnest_run_with_a_cuda_provider_here_fails_before_any_worker_starts(digits_doc,
                                                                             tmp_path):
    digits_doc["spec"]["providers"][3]["device"] = "cuda"
    run = LocalRun(parse_job(digits_doc), tmp_path / "out", progress=False)
    with pytest.raises(RavnestError, match=r"^spec\.providers\[3\]\.device: device 'cuda', but "
                                           r"torch"):
        run.prepare()
    assert not (tmp_path / "out" / "nodes").exists() and not run.procs


def test_host_tensors_stay_and_nested_state_comes_to_the_host():
    t = torch.ones(2)
    state = {"a": t, "b": [t, (t, 3)], "c": "x"}
    assert devices.put(state, torch.device("cpu"))["a"] is t
    host = devices.on_host(state)
    assert host["b"][1][1] == 3 and host["c"] == "x" and host["a"] is t


def test_a_cpu_stage_sends_its_tensors_as_they_are_and_its_loss_as_a_number():
    """On the CPU nothing is copied and nothing waited for (no `ready`); a loss left as a 0-d
    tensor (a device's, read when sent) is a number in the control that leaves."""
    place = Placement()
    x = torch.randn(3, 4)
    tensors, control, ready = place.outgoing({"x": x}, {"n": 4, "loss": torch.tensor(0.25)})
    assert tensors["x"] is x and ready is None and place.mover is None
    assert control == {"n": 4, "loss": 0.25} and isinstance(control["loss"], float)


def test_the_roots_mean_loss_is_read_only_when_taken():
    from ravnest.train.curves import LossMeter

    meter = LossMeter()
    meter.add(torch.tensor(1.0), 2)  # a root that is its cluster's leaf: the device's loss
    meter.add(0.5, 2)
    assert meter.take() == pytest.approx(0.75) and meter.take() is None


def test_a_precision_autocasts_the_stage_and_fp32_leaves_it_alone():
    layer = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with Placement(precision="bf16").autocast():
        assert layer(x).dtype == torch.bfloat16
    with Placement().autocast():
        assert layer(x).dtype == torch.float32
    with pytest.raises(RavnestError, match="precision 'fp8'"):
        Placement(precision="fp8")


def test_a_precision_that_is_not_offered_is_refused_with_its_path(digits_doc):
    digits_doc["spec"]["training"]["precision"] = "fp8"
    with pytest.raises(SpecError, match=r"spec\.training\.precision"):
        parse_job(digits_doc)


def test_the_loss_scale_backs_off_after_an_overflow_anywhere_and_grows_after_a_clean_run():
    s = LossScale(scale=8.0, growth_interval=3)
    s.update(overflowed=True)
    assert s.scale == 4.0
    s.told = True  # (a stage before the leaf overflowed: its next forward said so)
    s.update(overflowed=False)
    assert (s.scale, s.told) == (2.0, False)
    for _ in range(3):
        s.update(overflowed=False)
    assert s.scale == 4.0 and s.clean == 0
    again = LossScale()
    again.load(s.state())
    assert (again.scale, again.clean) == (4.0, 0)


def test_unscaling_divides_the_gradients_and_finds_one_that_overflowed():
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    a.grad, b.grad = torch.full((2,), 8.0), torch.full((3,), 4.0)
    assert unscale([a, b], 4.0)
    assert a.grad.tolist() == [2.0, 2.0] and b.grad.tolist() == [1.0] * 3
    b.grad[1] = float("inf")
    assert not unscale([a, b], 2.0)


def test_running_out_of_device_memory_names_the_node_its_stage_and_the_memory_planned(
        digits_doc):
    from types import SimpleNamespace

    from ravnest import plan_job
    from ravnest.run.worker import Worker

    plan, _, _ = plan_job(parse_job(digits_doc))
    node = plan.node("node_3")
    worker = SimpleNamespace(me=node, device=torch.device("cpu"))
    error = Worker._out_of_memory(worker, torch.OutOfMemoryError(  # type: ignore[arg-type]
        "CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    said = str(error)
    assert said.startswith(f"node_3 (cluster {node.cluster}, stage {node.stage}: layers "
                           f"{node.first_layer} to {node.last_layer}) ran out of memory on cpu: "
                           f"the plan gave its stage {node.memory_bytes / 2**30:.2f} GiB")
    assert said.endswith("(CUDA out of memory. Tried to allocate 2.00 GiB)")


@needs_no_cuda
def test_the_seed_apis_node_on_a_cuda_device_torch_cannot_see_says_so(tmp_path):
    from ravnest.seed.node import Node

    with pytest.raises(RavnestError, match=r"^Node\('node_0', device='cuda'\): device 'cuda', "
                                           r"but torch"):
        Node(name="node_0", device=torch.device("cuda"), node_data=tmp_path)
