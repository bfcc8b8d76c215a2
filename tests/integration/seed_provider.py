"""A provider script in the seeds' walkthrough style: `python seed_provider.py node_3`."""

import sys

import torch
from torch.utils.data import DataLoader

from ravnest import Node, Trainer, set_seed
from ravnest.examples.digits import datasets

set_seed(42)


def preprocess_dataset():
    train, val = datasets()
    generator = torch.Generator().manual_seed(42)
    train_loader = DataLoader(train, batch_size=32, shuffle=True, generator=generator,
                              drop_last=True)
    return train_loader, DataLoader(val, batch_size=64)


def loss_fn(predictions, targets):
    # targets: the batch the `labels` loader yields, (X, y) as in Ravnest's examples
    return torch.nn.functional.cross_entropy(predictions, targets[1])


if __name__ == "__main__":
    train_loader, val_loader = preprocess_dataset()
    node = Node(name=sys.argv[1], optimizer=torch.optim.Adam, optimizer_params={"lr": 0.003},
                criterion=loss_fn, labels=train_loader, test_labels=val_loader,
                reduce_factor=4, listen_host="127.0.0.1")
    trainer = Trainer(node=node, train_loader=train_loader, val_loader=val_loader, epochs=3,
                      batch_size=32, save=True)
    trainer.train()
    accuracy = trainer.evaluate()
    if accuracy is not None:
        print(f"accuracy {accuracy:.4f}")
