"""A ReduceLROnPlateau scheduler steps on the validation loss at every stage (issue 38 item 5:
a job with it passed `ravnest validate`, and every worker died at the first epoch's end,
"ReduceLROnPlateau.step() missing 1 required positional argument: 'metrics'"). Against
single-process PyTorch: the pipeline of tests/inprocess.py, with its stages' schedulers made
ReduceLROnPlateau, trains the weights that whole-model training stepping torch's own scheduler
on its validation loss after each epoch trains."""

from __future__ import annotations

from typing import Any

import inprocess
import pytest
import torch

EPOCHS = 4
LR = 0.05


def plateau_of(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    # mode "max" on a loss that falls: every epoch after the first is "worse", so with patience 0
    # the rate halves after epochs 1 and 2 and the epochs after them train at it
    opt = torch.optim.SGD(params, lr=LR)
    return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                           patience=0)


def reference(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Whole-model training as tests/inprocess.py's reference (one cluster), the scheduler
    stepped on the validation loss (its one batch: epoch 0, batch 0) after each epoch; the
    weights and the rate each epoch trained at."""
    opt, scheduler = plateau_of(list(model.parameters()))
    rates = []
    for epoch in range(EPOCHS):
        rates.append(opt.param_groups[0]["lr"])
        for first in range(0, xs.shape[1], inprocess.UPDATE_FREQUENCY):
            opt.zero_grad()
            update = range(first, min(first + inprocess.UPDATE_FREQUENCY, xs.shape[1]))
            for b in update:
                x, y = xs[epoch, b].flatten(0, 1), ys[epoch, b].flatten(0, 1)
                (torch.nn.functional.cross_entropy(model(x), y) / len(update)).backward()
            opt.step()
        with torch.no_grad():
            val = torch.nn.functional.cross_entropy(model(xs[0, 0, 0]), ys[0, 0, 0]).item()
        scheduler.step(val)
    return model.state_dict(), rates


@pytest.mark.parametrize("step_on", ["epoch", "step"])
def test_plateau_scheduler_steps_on_the_validation_loss_at_every_stage(monkeypatch, step_on):
    """`step_on` "step" too (the seed API's lr_step_on_epoch_change=False): a plateau scheduler
    has no loss to step on after an update, and steps after each validation all the same."""
    monkeypatch.setattr(inprocess, "EPOCHS", EPOCHS)
    monkeypatch.setattr(inprocess, "optimizer_of", plateau_of)
    runtimes, initial, xs, ys = inprocess.train(1, scheduler_step_on=step_on)
    expected, rates = reference(initial, xs, ys)
    assert rates == [LR, LR, LR / 2, LR / 4]  # (the reference itself: the rate did change)
    trained = {k: v for rt in runtimes for k, v in rt.stage.stage_state_dict().items()}
    assert trained.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(trained[k], v, rtol=0, atol=1e-5, msg=k)
    for rt in runtimes:  # every stage's scheduler took the same decisions on the same losses
        assert rt.optimization.optimizer.param_groups[0]["lr"] == LR / 8, rt.name
