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
