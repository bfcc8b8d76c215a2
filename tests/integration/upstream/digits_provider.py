"""A provider script written the way Ravnest's published digits example is: scikit-learn's digits
as float64 numpy arrays with one-hot float targets, a DataLoader of (X, y) pairs (batch size 64,
so the last batch is partial) passed as both `train_loader` and `labels`, an MSE criterion that
takes `targets[1]`, `inputs_dtype`, `val_freq`. Run as `python digits_provider.py node_<i>
<epochs> <val_freq>`."""

import sys

import numpy as np
import torch
from sklearn import datasets
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader

from ravnest import Node, Trainer, set_seed

set_seed(42)


def to_categorical(x, n_col=None):
    if not n_col:
        n_col = np.amax(x) + 1
    one_hot = np.zeros((x.shape[0], n_col))
    one_hot[np.arange(x.shape[0]), x] = 1
    return one_hot


def preprocess_dataset():
    data = datasets.load_digits()
    X = data.data / 16.0
    y = to_categorical(data.target.astype("int"))
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.4, random_state=1)
    X_train = X_train.reshape((-1, 1, 8, 8))
    X_test = X_test.reshape((-1, 1, 8, 8))
    generator = torch.Generator()
    generator.manual_seed(42)
    y_train = torch.tensor(y_train, dtype=torch.float32)
    y_test = torch.tensor(y_test, dtype=torch.float32)
    train_loader = DataLoader(list(zip(X_train, y_train, strict=True)), generator=generator,
                              shuffle=True, batch_size=64)
    val_loader = DataLoader(list(zip(X_test, y_test, strict=True)), shuffle=False,
                            batch_size=64)
    return train_loader, val_loader


def loss_fn(preds, targets):
    return torch.nn.functional.mse_loss(preds, targets[1])


if __name__ == "__main__":
    name, epochs, val_freq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    train_loader, val_loader = preprocess_dataset()
    node = Node(name=name, optimizer=torch.optim.Adam, optimizer_params={"lr": 0.003},
                device=torch.device("cpu"), criterion=loss_fn, labels=train_loader,
                test_labels=val_loader)
    trainer = Trainer(node=node, train_loader=train_loader, val_loader=val_loader,
                      val_freq=val_freq, epochs=epochs, batch_size=64, save=True,
                      inputs_dtype=torch.float32)
    trainer.train()
    trainer.evaluate()
