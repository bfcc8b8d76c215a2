"""Submodules kept whole when tracing: Ravnest's leaf marker, and the fallback for submodules
torch.fx cannot trace through (minGPT's `self.bias[:, :, :T, :T]`)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from gpt_model import GPT, Block, sort_dataset, sorter_loss
from models import SkipNet
from torch import fx, nn

from ravnest import clusterize
from ravnest.errors import PlanError
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import LEAF_MARKER, OUTPUT, build_stage, profile
from ravnest.plan.planning import make_plan
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run.local import free_ports
from ravnest.train.fusing import ordered_like

ATTN = ("h.0.attn", "h.1.attn")


def _gpt(marked: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=3, block_size=11, n_layer=2, n_head=2, n_embd=16, marked=marked)


def test_plain_torch_fx_cannot_trace_the_gpt() -> None:
    with pytest.raises(TypeError, match="slice indices"):
        fx.symbolic_trace(_gpt(marked=False))


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_the_attention_is_kept_whole_as_one_layer(marked: bool) -> None:
    model = _gpt(marked)
    x, _ = sort_dataset(8)
    _, prof = profile(model, [x])
    assert tuple(name for name, _ in prof.kept_whole) == ATTN
    why = "marked as a leaf" if marked else "torch.fx cannot trace it: TypeError: slice indices"
    assert all(reason.startswith(why) for _, reason in prof.kept_whole)
    attn = [layer for layer in prof.layers if layer.target in ATTN]
    assert [layer.op for layer in attn] == ["call_module"] * 2
    assert not any(layer.target.startswith(ATTN) for layer in prof.layers if layer not in attn)
    assert set(attn[0].state) == {k for k in model.state_dict() if k.startswith("h.0.attn.")}
    # the rest of each block is traced through as usual
    assert {"h_0_ln_1", "h_0_mlp_0", "h_1_mlp_2", "lm_head"} <= {la.name for la in prof.layers}


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_stages_around_a_kept_whole_module_equal_the_model(marked: bool) -> None:
    model = _gpt(marked)
    reference = copy.deepcopy(model)
    x, y = sort_dataset(16, seed=1)
    gm, prof = profile(model, [x])
    names = [layer.name for layer in prof.layers]
    bounds = [0, names.index("h_0_attn"), names.index("h_1_attn") + 1, len(names)]
    assert all(prof.cut_ok[b - 1] for b in bounds[1:-1])
    stages = [build_stage(gm, a, b) for a, b in itertools.pairwise(bounds)]
    assert "h.0.attn.c_attn.weight" in stages[1].stage_state_dict()

    env = {"idx": x}
    for st in stages:
        env = st(**env)
    out = env[OUTPUT]
    want = reference(x)
    torch.testing.assert_close(out, want)

    sorter_loss(out, y).backward()
    sorter_loss(want, y).backward()
    got = {k: v for st in stages for k, v in st.stage_state_dict(keep_vars=True).items()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, msg=name)

    # fusing the stages gives exactly the model's state_dict keys, in its order
    fused = {k: v for st in stages for k, v in st.stage_state_dict().items()}
    assert list(ordered_like(fused, model.state_dict())) == list(model.state_dict())


def test_the_plan_says_which_modules_were_kept_whole() -> None:
    x, _ = sort_dataset(8)
    _, prof = profile(_gpt(marked=False), [x])
    plan = make_plan(prof, [ProviderInfo(1.0, 1000)] * 3, Workload(batch_size=8), clusters=1)
    assert tuple(name for name, _ in plan.kept_whole) == ATTN
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    table = plan.table()
    assert "kept whole (one layer): h.0.attn (torch.fx cannot trace it" in table
    assert "kept whole (one layer): h.1.attn" in table


def test_a_traceable_model_profiles_and_plans_as_before() -> None:
    torch.manual_seed(0)
    model = SkipNet(dropout=0.5)
    _, prof = profile(model, [torch.randn(8, 16)])
    assert prof.kept_whole == ()
    plain = [(n.name, n.op, str(n.target)) for n in fx.symbolic_trace(model).graph.nodes
             if n.op not in ("placeholder", "output")]
    assert [(la.name, la.op, la.target) for la in prof.layers] == plain
    plan = make_plan(prof, [ProviderInfo(1.0, 1000)] * 2, Workload(batch_size=8), clusters=1)
    assert "kept_whole" not in plan.to_dict() and "kept whole" not in plan.table()


def test_classes_and_names_given_as_leaves_are_kept_whole() -> None:
    x, _ = sort_dataset(8)
    _, prof = profile(_gpt(marked=False), [x], leaves=[Block])
    assert [name for name, _ in prof.kept_whole] == ["h.0", "h.1"]
    _, prof = profile(_gpt(marked=True), [x], leaves=["h.1"])
    assert [name for name, _ in prof.kept_whole] == ["h.0.attn", "h.1"]


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


class _Outer(nn.Module):
    """Traces only when its inner gate is kept whole; then fails on the gate's output as a
    proxy, so the outer module is kept whole instead (and only it is reported)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate(self.fc(x))
        return y[: int(y.shape[0])]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), _Outer())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_a_parent_that_fails_after_its_child_was_kept_whole_is_kept_whole_instead() -> None:
    model = _Net()
    x = torch.randn(3, 4)
    gm, prof = profile(model, [x])
    assert [name for name, _ in prof.kept_whole] == ["inner.1"]
    assert [la.name for la in prof.layers] == ["inner_0", "inner_1", "head"]
    torch.testing.assert_close(gm(x), model(x))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


def test_a_model_whose_own_forward_cannot_be_traced_is_still_refused() -> None:
    with pytest.raises(PlanError, match=f"cannot be traced by torch.fx.*{LEAF_MARKER}"):
        profile(_Branchy(), [torch.randn(2, 4)])


def test_clusterize_splits_the_gpt(tmp_path) -> None:
    ports = free_ports(3)
    (tmp_path / "node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": 2, "bandwidth": 100}}
        for i, p in enumerate(ports)}))
    x, _ = sort_dataset(16)
    plan = clusterize(model=_gpt(marked=False), example_args=(x,), pass_data=True,
                      node_data=tmp_path, clusters=1)
    assert len(plan.nodes) == 3
    assert tuple(name for name, _ in plan.kept_whole) == ATTN
    for n in plan.nodes:
        assert (tmp_path / "nodes" / f"{n.name}.json").exists()
        assert (tmp_path / "nodes" / f"{n.name}.submodel.pt").exists()
