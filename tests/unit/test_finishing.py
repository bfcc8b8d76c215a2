"""A run's outputs (`ravnest.run.finishing.finish`) when the first cluster rejoined only after the
final round (restarted too near the end): seen in a local run, where it left the summary without
losses, no best model, and `ravnest run` failing on a None as it printed its last line."""

from __future__ import annotations

import io

import torch
import yaml

from ravnest import parse_job, plan_job
from ravnest.cli import main
from ravnest.run import finishing
from ravnest.storing import open_location


def _finished_run(folder, digits_doc):
    """A run folder whose clusters all finished with the same weights, cluster 0's root having
    rejoined after the final round (no validation, curve or best weights of its own)."""
    job = parse_job(digits_doc)
    plan, _, _ = plan_job(job)
    model = finishing.building.build_model(job.spec)
    torch.manual_seed(0)
    trained = {k: v + torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v
               for k, v in model.state_dict().items()}
    best = {k: v * 0.5 if v.is_floating_point() else v for k, v in trained.items()}
    where = open_location(folder)
    for node in plan.nodes:
        names = list(node.state)  # (the model's state this node's stage holds)
        buf = io.BytesIO()
        torch.save({"cluster": node.cluster, "stage": node.stage,
                    "state": {k: trained[k] for k in names},
                    "best": None if node.cluster == 0 else {k: best[k] for k in names}}, buf)
        where.child("stages").write(f"{node.name}.pt", buf.getvalue())
    for c in plan.clusters:
        rejoined = c.id == 0
        finishing.write_cluster(where, c.id, {
            "cluster": c.id, "updates": 176, "samples": 5632, "rounds_skipped": 0,
            "train_loss": None if rejoined else 0.01, "epoch": None if rejoined else 8,
            "best_step": None if rejoined else 150, "val_loss": None if rejoined else 0.05,
            "val_metric": None if rejoined else 0.98, "resumed_from": 0, "seconds": 10.0,
            "rejoined": {"round": None, "updates": 176} if rejoined else None,
            "curve": [] if rejoined else [
                {"epoch": 7, "step": 176, "samples": 5632, "train_loss": 0.01, "val_loss": 0.05,
                 "val_metric": 0.98, "time": 1.0}]})
    return job, plan, where, trained, best


def test_the_outputs_come_from_a_cluster_that_validated(tmp_path, digits_doc):
    job, plan, where, trained, best = _finished_run(tmp_path, digits_doc)
    summary = finishing.finish(job, plan, where)
    assert summary["val_loss"] == 0.05 and summary["train_loss"] == 0.01, summary
    assert summary["best_step"] == 150 and summary["best_model"] is not None
    assert summary["clusters"] == 2 and summary["rejoined"] == {
        "0": {"round": None, "updates": 176}}
    model = torch.load(io.BytesIO(where.read("model.pt")), weights_only=True)
    kept = torch.load(io.BytesIO(where.read("best_model.pt")), weights_only=True)
    assert list(model) == list(trained)
    for k in trained:
        torch.testing.assert_close(model[k], trained[k], rtol=0, atol=0)
        torch.testing.assert_close(kept[k], best[k], rtol=0, atol=0)


def test_a_run_without_any_validation_still_says_what_it_did(tmp_path, digits_doc, capsys,
                                                            monkeypatch):
    """No cluster validated (each of its figures None): `ravnest run` says what it trained and
    where the outputs are, and leaves out the figures it does not have."""
    summary = {"updates": 176, "samples_trained": 5632, "samples_per_second": 563.2,
               "resumed_from_step": 0, "train_loss": None, "val_loss": None,
               "fused_val_metric": 0.97, "model": f"{tmp_path}/model.pt"}
    monkeypatch.setattr("ravnest.run.local.run_job", lambda *a, **k: summary)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    assert main(["run", str(job), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("done: 176 updates, 563.2 samples/s, val accuracy 0.9700\n"), said
