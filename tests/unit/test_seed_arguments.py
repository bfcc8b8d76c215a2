"""The seed API's wrong calls (issue 40, item 4): each gets a SpecError naming the call, the
argument, the value and what is expected, before anything is read, planned, written or
connected (no node_data folder exists here: a call that got past its checks would fail on
that instead). Before these checks none of the 33 calls below named its wrong argument: 22 failed
on the missing node_data instead (with one, they went on: the issue saw ZeroDivisionError,
IndexError, "'str' object is not callable"), 6 of Trainer's were accepted, 2 ended in a raw
RuntimeError or TypeError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ravnest.errors import SpecError
from ravnest.seed.clustering import clusterize
from ravnest.seed.fusion import model_fusion
from ravnest.seed.node import Node
from ravnest.seed.trainer import Trainer

MODEL = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
X = torch.rand(8, 1, 8, 8)


def _cluster(**given: Any) -> Callable[[Path], object]:
    return lambda folder: clusterize(**{"model": MODEL, "example_args": (X,),
                                        "node_data": folder, **given})


def _node(**given: Any) -> Callable[[Path], object]:
    return lambda folder: Node(**{"name": "node_0", "node_data": folder, **given})


def _trainer(**given: Any) -> Callable[[Path], object]:
    return lambda folder: Trainer(**{"node": None, "train_loader": [], **given})


WRONG = [
    # (call, the argument and value the error names, what it says is expected)
    (_cluster(model=None), "model=None", "a torch.nn.Module"),
    (_cluster(model="resnet"), "model='resnet'", "a torch.nn.Module"),
    (_cluster(example_args=X), "example_args=<a Tensor of shape (8, 1, 8, 8)>",
     "a tuple of example inputs, e.g. (x,)"),
    (_cluster(example_args=()), "example_args=()", "a non-empty tuple of example input tensors"),
    (_cluster(example_args=([1, 2],)), "example_args=([1, 2],)", "example input tensors"),
    (_cluster(clusters=0), "clusters=0", "a whole number, 1 or more, or None"),
    (_cluster(clusters=-2), "clusters=-2", "a whole number, 1 or more"),
    (_cluster(clusters=2.5), "clusters=2.5", "a whole number"),
    (_cluster(batch_size=0), "batch_size=0", "a whole number, 1 or more"),
    (_cluster(microbatches=0), "microbatches=0", "a whole number, 1 or more"),
    (_cluster(optimizer=123), "optimizer=123", "the name of an optimizer in torch.optim"),
    (_cluster(optimizer="Adamm"), "optimizer='Adamm'", "the name of an optimizer"),
    (_cluster(node_data=None), "node_data=None", "a path"),
    (_cluster(tls="yes"), "tls='yes'", "True or False"),
    (_node(name=0), "", "name: must look like 'node_0'"),
    (_node(optimizer="Adam"), "optimizer='Adam'", "an optimizer class such as torch.optim.Adam"),
    (_node(optimizer=123), "optimizer=123", "an optimizer class"),
    (_node(optimizer=torch.optim.SGD(MODEL.parameters(), lr=0.1)), "optimizer=SGD",
     "the optimizer's class (torch.optim.Adam), not an optimizer made already"),
    (_node(optimizer_params=[0.01]), "optimizer_params=[0.01]", "a dict of keyword arguments"),
    (_node(criterion=5), "criterion=5", "a loss function"),
    (_node(update_frequency=0), "update_frequency=0", "a whole number, 1 or more"),
    (_node(reduce_factor=0), "reduce_factor=0", "a whole number, 1 or more, or None"),
    (_node(labels=5), "labels=5", "a torch.utils.data.DataLoader"),
    (_node(compression=3), "compression=3", "True, False or a wire format"),
    (_node(outer="diloco"), "outer='diloco'", "True, None or a dict of training.outer's"),
    (_node(example_args=X), "example_args=<a Tensor", "a tuple of example inputs"),
    (_node(lr_scheduler="StepLR"), "lr_scheduler='StepLR'", "a scheduler class"),
    (_trainer(epochs=0), "epochs=0", "a whole number, 1 or more"),
    (_trainer(val_freq=0), "val_freq=0", "a whole number, 1 or more"),
    (_trainer(batch_size=-1), "batch_size=-1", "a whole number, 1 or more"),
    (_trainer(train_loader=5), "train_loader=5", "a torch.utils.data.DataLoader"),
    (_trainer(inputs_dtype="float32"), "inputs_dtype='float32'", "a torch dtype"),
    (_trainer(), "node=None", "the provider's ravnest Node"),
    (lambda folder: model_fusion(cluster_id=-1, trained_dir=folder), "cluster_id=-1",
     "a whole number, 0 or more"),
]


@pytest.mark.parametrize(("call", "names", "expected"), WRONG,
                         ids=[f"{i}-{w[1] or w[2]}"[:40] for i, w in enumerate(WRONG)])
def test_a_wrong_argument_is_named_with_its_value_and_what_is_expected(
        tmp_path: Path, call: Callable[[Path], object], names: str, expected: str) -> None:
    folder = tmp_path / "node_data"
    with pytest.raises(SpecError) as raised:
        call(folder)
    said = str(raised.value)
    assert names in said and expected in said, said
    assert not folder.exists()  # nothing was written


def test_every_wrong_argument_of_a_call_is_named_at_once(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as raised:
        clusterize(MODEL, X, clusters=0, microbatches=0, node_data=tmp_path)
    assert [p.split(":")[1].strip() for p in raised.value.problems] == [
        "example_args=<a Tensor of shape (8, 1, 8, 8)>", "clusters=0", "microbatches=0"]
