"""Provider scripts written the way Ravnest's published examples are run unchanged, each provider
its own process: clusterize over node_configs.json, `python provider.py node_<i>`, model_fusion,
and the fused state_dict strictly loaded into a fresh model and scored.

The digits example (upstream's own: one-hot float targets with an MSE criterion that takes
`targets[1]` of the `labels` loader's (X, y) batches, float64 inputs cast by `inputs_dtype`,
`val_freq`, batch size 64 so the last batch is partial) is also trained in this process with plain
PyTorch on the same batches: the three providers' fused model must equal it, which holds only if
the criterion got the right targets and every batch, the partial one included, was trained.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from seed_processes import run_providers, write_node_configs
from sklearn import datasets
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader

from ravnest import clusterize, model_fusion, set_seed

HERE = Path(__file__).parent / "upstream"
sys.path.insert(0, str(HERE))

from digits_cnn import CNN  # noqa: E402

EPOCHS, VAL_FREQ = 4, 2


def _digits() -> tuple[np.ndarray, ...]:
    data = datasets.load_digits()
    y = np.eye(10)[data.target]
    x_train, x_test, y_train, y_test = train_test_split(data.data / 16.0, y, test_size=0.4,
                                                        random_state=1)
    return x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8), y_train, y_test


def _single_process(x_train: np.ndarray, y_train: np.ndarray) -> dict[str, torch.Tensor]:
    """Upstream's loop on one machine: the same initial model, batches and optimizer."""
    set_seed(42)
    model = CNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    targets = torch.tensor(y_train, dtype=torch.float32)
    loader = DataLoader(list(zip(x_train, targets, strict=True)),
                        generator=torch.Generator().manual_seed(42), shuffle=True, batch_size=64)
    model.train()
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(torch.float32)), y).backward()
            optimizer.step()
    return model.state_dict()


def test_upstream_digits_example_trains_as_plain_pytorch_does(tmp_path, monkeypatch,
                                                                capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write_node_configs(tmp_path, [8, 8, 8])
    set_seed(42)
    plan = clusterize(model=CNN(), example_args=(torch.rand(64, 1, 8, 8),))
    shown = capsys.readouterr().out
    # three equal providers: one cluster of three stages, as upstream forms (item 5), printed
    assert len(plan.clusters) == 1 and len(plan.nodes) == 3 and not plan.rings
    assert all(f"Node({i}, Cluster(0))" in shown and "127.0.0.1:" in shown for i in range(3))

    outputs = run_providers(tmp_path, HERE / "digits_provider.py", 3, str(EPOCHS),
                             str(VAL_FREQ))
    root = plan.clusters[0].nodes[0]
    out = outputs[int(root.removeprefix("node_"))]
    x_train, x_test, y_train, y_test = _digits()
    batches = -(-len(x_train) // 64)
    assert len(x_train) % 64, "the example must end each epoch with a partial batch"
    # every batch is trained, the partial one too (item 3), and the root says so per epoch
    assert f"({EPOCHS * len(x_train)} samples, {EPOCHS * batches} updates)" in out, out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("Epoch")] == [
        f"Epoch {e}/{EPOCHS}" for e in range(1, EPOCHS + 1)]
    losses = Path("losses.txt").read_text().split()
    assert len(losses) == EPOCHS * batches and float(losses[-1]) < float(losses[0])
    # one-hot targets: the accuracy is that of argmax (item 2), validated every VAL_FREQ epochs
    accuracies = [float(a) for a in Path("val_accuracies.txt").read_text().split()]
    assert len(accuracies) == EPOCHS // VAL_FREQ

    fused = model_fusion(cluster_id=0)
    model = CNN()
    model.load_state_dict(torch.load("trained/trained_state_dict.pt", weights_only=True),
                          strict=True)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.tensor(x_test, dtype=torch.float32)).argmax(1)
    accuracy = (predicted == torch.tensor(y_test).argmax(1)).float().mean().item()
    assert accuracy > 0.9 and abs(accuracy - accuracies[-1]) < 1e-6
    assert f"validation accuracy {accuracies[-1]:.4f}" in out

    # the criterion got the labels loader's batches and every batch was trained (items 1, 3)
    reference = _single_process(x_train, y_train)
    assert sorted(fused) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(fused[name].to(value.dtype), value, rtol=1e-4, atol=1e-5,
                                   msg=name)
