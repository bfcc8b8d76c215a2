"""Split parity: stages of a split model compute exactly what the whole model computes."""

from __future__ import annotations

import itertools

import pytest
import torch
from models import SkipNet

from ravnest.errors import PlanError
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import OUTPUT, build_stage, profile
from ravnest.plan.planning import make_plan
from ravnest.plan.plans import ProviderInfo


def run_stages(stages, x):
    env = {"x": x}
    for st in stages:
        env = st(**env)
    return env[OUTPUT]


@pytest.fixture
def split():
    torch.manual_seed(0)
    model = SkipNet(dropout=0.5)
    gm, prof = profile(model, [torch.randn(8, 16)])
    names = [layer.name for layer in prof.layers]
    # stage 0: fc1, bn, relu | stage 1: fc2 .. tanh | stage 2: add, out
    bounds = [0, names.index("fc2"), names.index("add"), len(names)]
    stages = [build_stage(gm, a, b) for a, b in itertools.pairwise(bounds)]
    return model, stages, prof


def test_skip_connection_passes_through_the_middle_stage(split):
    _, stages, _ = split
    # h = relu(bn(fc1(x))) is made in stage 0 and added in stage 2: stage 1 must forward it.
    assert stages[0].output_names == ("relu",)
    assert "relu" in stages[1].input_names and "relu" in stages[1].output_names
    assert "relu" in stages[2].input_names


def test_planner_splits_within_memory_and_covers_every_layer(split):
    _, _, prof = split
    plan = make_plan(prof, [ProviderInfo(1.0, 1000)] * 3, Workload(batch_size=8), clusters=1)
    nodes = plan.cluster_nodes(0)
    assert [n.role for n in nodes] == ["root", "stem", "leaf"]
    assert nodes[0].start == 0 and nodes[-1].end == len(prof.layers)
    assert all(a.end == b.start for a, b in itertools.pairwise(nodes))
    assert sorted(s for n in nodes for s in n.state) == sorted(prof.state_names)


@pytest.mark.parametrize("train", [True, False])
def test_split_equals_full_model(split, train):
    model, stages, _ = split
    x = torch.randn(8, 16)
    model.train(train)
    for st in stages:
        st.train(train)
    torch.manual_seed(123)
    expected = model(x)
    torch.manual_seed(123)
    got = run_stages(stages, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_eval_switches_dropout_and_batchnorm(split):
    _, stages, _ = split
    x = torch.randn(8, 16)
    for st in stages:
        st.eval()
    a, b = run_stages(stages, x), run_stages(stages, x)
    torch.testing.assert_close(a, b)  # dropout off
    for st in stages:
        st.train()
    torch.manual_seed(1)
    c = run_stages(stages, x)
    assert not torch.allclose(a, c)  # dropout and batch statistics on


def test_batchnorm_running_stats_update_in_the_stage(split):
    model, stages, _ = split
    before = model.bn.running_mean.clone()
    for st in stages:
        st.train()
    run_stages(stages, torch.randn(8, 16) + 3)
    assert not torch.equal(before, model.bn.running_mean)


def test_fused_names_equal_original_state_dict(split):
    model, stages, _ = split
    fused = {}
    for st in stages:
        fused.update(st.stage_state_dict())
    assert sorted(fused) == sorted(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(fused[k], v)


def test_gradients_through_stages_equal_full_backward(split):
    model, stages, _ = split
    x = torch.randn(8, 16)
    model.eval()
    for st in stages:
        st.eval()
    model(x).square().sum().backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    # stage by stage, as the pipeline does it: detach between stages, send gradients back
    env = {"x": x}
    saved = []
    for st in stages:
        inputs = {k: v.detach().requires_grad_(v.dtype.is_floating_point) for k, v in env.items()}
        out = st(**inputs)
        saved.append((inputs, out))
        env = out
    grads = None
    for inputs, out in reversed(saved):
        if grads is None:
            out[OUTPUT].square().sum().backward()
        else:
            keys = [k for k in grads if out[k].requires_grad]
            torch.autograd.backward([out[k] for k in keys], [grads[k] for k in keys])
        grads = {k: v.grad for k, v in inputs.items() if v.grad is not None}
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k])


def test_more_stages_than_layers_is_an_error():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    _, prof = profile(model, [torch.randn(2, 4)])
    with pytest.raises(PlanError, match="more stages than layers"):
        make_plan(prof, [ProviderInfo(1.0)] * 4, Workload(batch_size=2), clusters=1)


def test_untraceable_model_names_the_problem():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(PlanError, match=r"cannot be traced by torch\.fx"):
        profile(Branchy(), [torch.randn(2)])
