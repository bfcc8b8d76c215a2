"""A provider script in Ravnest's style whose chosen provider fails:
`python failing_provider.py node_<i> <epochs> <failing node or -> <criterion call that raises>`.

Every provider runs the same script (as Ravnest's providers do); only the one named by the third
argument has a criterion that raises ValueError("boom") at the given call (counted from 1). With
"-" nobody fails (a test kills a provider from outside instead)."""

import sys

import torch
from torch.utils.data import DataLoader

from ravnest import Node, Trainer, set_seed
from ravnest.examples.digits import datasets

set_seed(42)


def loaders():
    train, val = datasets()
    generator = torch.Generator().manual_seed(42)
    train_loader = DataLoader(train, batch_size=32, shuffle=True, generator=generator)
    return train_loader, DataLoader(val, batch_size=64)


def criterion(name, failing, fail_at):
    calls = [0]

    def loss_fn(predictions, targets):
        calls[0] += 1
        if name == failing and calls[0] == fail_at:
            raise ValueError("boom")
        return torch.nn.functional.cross_entropy(predictions, targets[1])

    return loss_fn


if __name__ == "__main__":
    name, epochs, failing, fail_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    train_loader, val_loader = loaders()
    node = Node(name=name, optimizer=torch.optim.Adam, optimizer_params={"lr": 0.003},
                criterion=criterion(name, failing, fail_at), labels=train_loader,
                test_labels=val_loader)
    print(f"{name}: started", flush=True)
    trainer = Trainer(node=node, train_loader=train_loader, val_loader=val_loader, epochs=epochs,
                      batch_size=32)
    trainer.train()
    print(f"{name}: finished", flush=True)
