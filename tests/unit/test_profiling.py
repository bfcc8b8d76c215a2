"""Profiling on fake tensors gives exactly the figures a real forward at the full batch gives.

The planner profiles the example input on fake tensors (shapes, no data; `Profile.method` FAKE)
and computes it for real only where fake tensors cannot run the model (RUN). Each test here
takes its reference directly: the traced graph run node by node on the real example at its full
batch (output bytes, whether a value is a tensor, FLOPs per node), a plain `model(x)` under
torch's FLOP counter (total FLOPs), and the model's own parameters and buffers, and asserts the
profile equals it: layers, cuts and bytes crossing them, parameter and buffer bytes. Timing is
not part of a profile. ResNet-50 on a [100, 3, 224, 224] example is planned in a child process,
whose peak RSS must stay under 2 GB (computed for real and held, it was 12 GB).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from ravnest.examples.digits import build_model as digits_model
from ravnest.examples.resnet import RESNET50_PARAMETERS, ResNet
from ravnest.examples.resnet import build_model as resnet50
from ravnest.examples.sorter import build_model as sorter_model
from ravnest.plan.partitioning import FAKE, RUN, Profile, profile


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, list | tuple):
        return sum(_nbytes(x) for x in v)
    return 0


class _Forward(fx.Interpreter):
    """A plain forward of the traced graph on real tensors, noting each node's output."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: dict[str, tuple[int, bool, int]] = {}
        """node name: (output bytes, output is a tensor, FLOPs)."""

    def run_node(self, n: fx.Node) -> Any:
        counter = FlopCounterMode(display=False)
        with counter:
            value = super().run_node(n)
        self.seen[n.name] = (_nbytes(value), isinstance(value, torch.Tensor),
                             int(counter.get_total_flops()))
        return value


def _reference_cuts(gm: fx.GraphModule, seen: dict[str, tuple[int, bool, int]],
                    layers: list[str]) -> tuple[list[bool], list[int]]:
    """Per layer i: whether every value made at or before it and used after it is a tensor
    (never after the last layer), and those values' bytes."""
    position = {name: i for i, name in enumerate(layers)}
    nodes = list(gm.graph.nodes)
    position.update({n.name: -1 for n in nodes if n.op == "placeholder"})
    ok, size = [], []
    for i in range(len(layers)):
        live = [n.name for n in nodes if n.name in position and position[n.name] <= i
                and any(u.op == "output" or position.get(u.name, -1) > i for u in n.users)]
        ok.append(i < len(layers) - 1 and all(seen[v][1] for v in live))
        size.append(sum(seen[v][0] for v in live))
    return ok, size


def _assert_exact(model: nn.Module, x: torch.Tensor, expect: str) -> Profile:
    """Profile `model` on `x` the planner's way and check it against a real full-batch forward."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    gm, prof = profile(model, [x])
    assert prof.method == expect
    assert model.training, "profile leaves the model's mode as it was"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(gm, fx.GraphModule)
    model.eval()
    forward = _Forward(gm)
    total = FlopCounterMode(display=False)
    with torch.no_grad():
        forward.run(x)
        with total:
            model(x)
    names = [layer.name for layer in prof.layers]
    assert [layer.out_bytes for layer in prof.layers] == [forward.seen[n][0] for n in names]
    assert [layer.flops for layer in prof.layers] == [forward.seen[n][2] for n in names]
    assert sum(layer.flops for layer in prof.layers) == total.get_total_flops()
    ok, size = _reference_cuts(gm, forward.seen, names)
    assert list(prof.cut_ok) == ok and list(prof.cut_bytes) == size
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for layer in prof.layers:
        assert layer.param_bytes == sum(_nbytes(params[s]) for s in layer.state if s in params)
        assert layer.buffer_bytes == sum(_nbytes(buffers[s]) for s in layer.state if s in buffers)
        assert layer.params == sum(params[s].numel() for s in layer.state if s in params)
    assert prof.param_bytes == sum(_nbytes(p) for p in model.parameters())
    assert prof.example_batch == x.shape[0]
    assert prof.state_names == tuple(model.state_dict())
    _, real = profile(model, [x], fake=False)
    assert real.method == RUN
    assert real.layers == prof.layers and real.cut_bytes == prof.cut_bytes
    assert real.cut_ok == prof.cut_ok
    return prof


def test_digits_cnn_on_fake_tensors_equals_a_real_forward() -> None:
    torch.manual_seed(0)
    _assert_exact(digits_model(), torch.rand(32, 1, 8, 8), FAKE)


def test_small_resnet_with_batchnorm_and_residual_adds_equals_a_real_forward() -> None:
    torch.manual_seed(0)
    prof = _assert_exact(ResNet((1, 1, 1, 1), num_classes=10), torch.rand(6, 3, 32, 32), FAKE)
    assert any(layer.name.startswith("add") for layer in prof.layers)
    assert any(layer.buffer_bytes for layer in prof.layers)


def test_resnet50_at_a_small_batch_equals_a_real_forward() -> None:
    torch.manual_seed(0)
    _assert_exact(resnet50(), torch.rand(2, 3, 96, 96), FAKE)


def test_transformer_with_integer_input_equals_a_real_forward() -> None:
    torch.manual_seed(0)
    _assert_exact(sorter_model(dim=32, layers=2), torch.randint(3, (8, 11)), FAKE)


class NotProportional(nn.Module):
    """Activations that do not scale with the batch: a fixed-size reshape, a fixed slice and a
    mean over the batch, broadcast back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.mix = nn.Linear(16 * 16, 8)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        grouped = self.mix(h.reshape(-1, 16 * 16))  # 16 rows per group, whatever the batch
        first = h[:3]  # at most 3 rows
        centre = h.mean(0, keepdim=True)  # one row
        return self.head(h - centre).sum() + grouped.sum() + first.sum()


def test_activations_not_proportional_to_the_batch_are_exact() -> None:
    torch.manual_seed(0)
    model = NotProportional()
    small = _assert_exact(model, torch.rand(32, 12), FAKE)
    large = _assert_exact(model, torch.rand(64, 12), FAKE)
    by_name = {layer.name: layer for layer in small.layers}
    ratios = {layer.name: layer.out_bytes / by_name[layer.name].out_bytes
              for layer in large.layers if by_name[layer.name].out_bytes}
    assert ratios["fc"] == 2 and ratios["getitem"] == 1 and ratios["mean"] == 1


class ValueGate(nn.Module):
    """Control flow on a tensor's value: torch.fx keeps it whole, fake tensors cannot run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class DataDependent(nn.Module):
    """A value-dependent shape (boolean mask) and value-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = ValueGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(self.fc(x))
        return h[h > 0].sum() + h.sum()


def test_a_model_fake_tensors_cannot_run_is_computed_for_real() -> None:
    torch.manual_seed(0)
    prof = _assert_exact(DataDependent(), torch.randn(16, 8), RUN)
    assert [name for name, _ in prof.kept_whole] == ["gate"]


def test_resnet50_has_torchvisions_parameters_and_names() -> None:
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == RESNET50_PARAMETERS == 25_557_032
    state = model.state_dict()
    assert len(state) == 320
    for name in ("conv1.weight", "bn1.running_var", "layer1.0.conv1.weight",
                 "layer1.0.downsample.0.weight", "layer1.0.downsample.1.num_batches_tracked",
                 "layer2.3.bn3.bias", "layer3.5.conv2.weight", "layer4.2.conv3.weight",
                 "fc.weight", "fc.bias"):
        assert name in state
    assert state["fc.weight"].shape == (1000, 2048)
    assert state["layer4.0.downsample.0.weight"].shape == (2048, 1024, 1, 1)
    assert resnet50(num_classes=10).fc.out_features == 10  # type: ignore[union-attr]


PLAN_RESNET50 = textwrap.dedent("""
    import json, torch
    from ravnest.examples.resnet import build_model
    from ravnest.plan.costs import Workload
    from ravnest.plan.partitioning import profile
    from ravnest.plan.planning import make_plan
    from ravnest.plan.plans import ProviderInfo
    torch.manual_seed(0)
    x = torch.rand((100, 3, 224, 224), generator=torch.Generator().manual_seed(0))
    _, prof = profile(build_model(), [x])
    plan = make_plan(prof, [ProviderInfo(8.0, 100.0)] * 4,
                     Workload(batch_size=100, microbatches=4, optimizer="SGD"))
    status = open("/proc/self/status").read().splitlines()
    peak = next(int(s.split()[1]) * 1024 for s in status if s.startswith("VmHWM:"))
    print(json.dumps({"peak": peak, "method": prof.method, "plan": plan.summary(),
                      "activation_bytes": sum(layer.out_bytes for layer in prof.layers)}))
""")


@pytest.mark.timeout(300)
def test_planning_resnet50_at_batch_100_peaks_under_2_gb() -> None:
    """Computed for real and held, the example's activations alone are 15 GB; on fake tensors
    the child holds torch, the model (100 MB) and the example (60 MB)."""
    out = subprocess.run([sys.executable, "-c", PLAN_RESNET50], capture_output=True, text=True,
                         timeout=280, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["method"] == FAKE
    assert result["activation_bytes"] == 15_024_732_800  # the same as a real forward's
    assert result["plan"] == "2x2"
    assert result["peak"] < 2 * 10**9, f"peak RSS {result['peak'] / 1e9:.2f} GB"
