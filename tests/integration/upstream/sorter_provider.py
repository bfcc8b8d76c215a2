"""A provider script written the way Ravnest's published minGPT sorter example is: a GPT whose
attention modules are marked as leaves (`_is_leaf_module = True`), digit-sorting sequences
(inputs `X`, next tokens `y` with -1 where the model is still reading the unsorted digits), an
unshuffled DataLoader of (X, y) pairs as `train_loader`, and the targets passed to the leaf as a
tensor, `labels=torch.tensor(y_train)`, with upstream's criterion
`cross_entropy(outputs.view(-1, outputs.size(-1)), targets.view(-1), ignore_index=-1)`.

The sequences are split into train and test by their input, as minGPT's SortDataset splits them
(a quarter of the possible inputs are test only), so the test sequences are never trained on.
Run as `python sorter_provider.py node_<i> <epochs>`; importing it gives the data and sizes.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

# the stage file `clusterize` wrote pickles the kept-whole attention module by its class, so the
# provider must be able to import tests/gpt_model.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpt_model import sort_dataset

from ravnest import Node, Trainer, set_seed

LENGTH, NUM_DIGITS = 6, 3
VOCAB, BLOCK = NUM_DIGITS, 2 * LENGTH - 1
N_LAYER, N_HEAD, N_EMBD = 2, 2, 32
BATCH_SIZE, LR = 48, 2e-3


def sorter_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test) as int64 numpy arrays: sequences from a fixed seed,
    those whose input is a test input (every fourth of the 3**6 possible, by its base-3 value)
    kept out of training and listed once each."""
    x, y = (t.numpy() for t in sort_dataset(2600, length=LENGTH, num_digits=NUM_DIGITS, seed=0))
    keys = (x[:, :LENGTH] * NUM_DIGITS ** np.arange(LENGTH)).sum(1)
    test = keys % 4 == 0
    first: dict[int, int] = {}
    for i in np.flatnonzero(test):
        first.setdefault(int(keys[i]), int(i))
    once = list(first.values())
    return x[~test], y[~test], x[once], y[once]


def sorter_criterion(outputs, targets):
    return F.cross_entropy(outputs.view(-1, outputs.size(-1)), targets.view(-1),
                           ignore_index=-1)


if __name__ == "__main__":
    set_seed(42)
    name, epochs = sys.argv[1], int(sys.argv[2])
    X_train, y_train, X_test, y_test = sorter_data()
    train_loader = DataLoader(list(zip(X_train, y_train, strict=True)), shuffle=False,
                              batch_size=BATCH_SIZE)
    val_loader = DataLoader(list(zip(X_test, y_test, strict=True)), shuffle=False,
                            batch_size=BATCH_SIZE)
    node = Node(name=name, optimizer=torch.optim.Adam, optimizer_params={"lr": LR},
                criterion=sorter_criterion, labels=torch.tensor(y_train),
                test_labels=torch.tensor(y_test), device=torch.device("cpu"))
    trainer = Trainer(node=node, train_loader=train_loader, val_loader=val_loader, save=True,
                      epochs=epochs, batch_size=BATCH_SIZE)
    trainer.train()
    trainer.evaluate()
