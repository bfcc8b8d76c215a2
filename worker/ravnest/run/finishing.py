"""Finishing: what a trained job leaves behind, the same for `ravnest run` and on Kubernetes.

Every worker writes its stage (trained and best weights) to ``stages/<node>.pt`` and every
cluster's root its figures and learning curve to ``clusters/cluster_<c>.json``, in the job's
output location: ``spec.output.uri`` (an object store or a claim, which outlive the pods), else
the run's own folder. Once every worker has succeeded, `finish` fuses cluster 0's stages into the
model with its original parameter names and writes beside them:

- ``model.pt``: the fused trained model (a state_dict that loads into a fresh model);
- ``best_model.pt``: the model at its lowest smoothed validation loss (when validation ran);
- ``learning_curve.csv`` and ``learning_curve.png``: every cluster's losses and metric per step;
- ``summary.json``: losses, the fused model's validation loss and metric, samples/s, the plan.

Locally the runner finishes; on Kubernetes a finishing pod of the job's own image does
(`ravnest finish`), so the operator never runs the job's code.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ravnest.errors import RavnestError
from ravnest.plan import building
from ravnest.plan.plans import Plan
from ravnest.spec import Job, JobSpec
from ravnest.storing import PVC_ROOT, Location, open_location
from ravnest.train.fusing import fuse_stages, load_stages, ordered_like

log = logging.getLogger(__name__)

STAGES = "stages"
CLUSTERS = "clusters"
OUTPUTS = {"model": "model.pt", "bestModel": "best_model.pt",
           "learningCurve": "learning_curve.csv", "learningCurvePng": "learning_curve.png",
           "summary": "summary.json"}
"""The files `finish` writes, by the name `status.outputs` gives each."""


def output_location(spec: JobSpec, base: str | Path, pvc_root: str = PVC_ROOT) -> Location:
    """Where the job's outputs go: spec.output.uri, else the folder `base`."""
    return open_location(spec.output.uri or base, spec.storage.options(pvc_root), base=base)


def write_cluster(where: Location, cluster: int, figures: dict[str, Any]) -> None:
    """A cluster root's figures and learning curve (``figures["curve"]``)."""
    where.child(CLUSTERS).write(f"cluster_{cluster}.json", json.dumps(figures, indent=1).encode())


def _save(where: Location, name: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    where.write(name, buf.getvalue())


def finish(job: Job, plan: Plan, where: Location, seconds: float | None = None,
           resumed_from: int | None = None, clusters: list[int] | None = None
           ) -> dict[str, Any]:
    """Fuse, evaluate and write the outputs in `where` from the stages and clusters there; return
    the summary. `clusters`: those that finished (default: those whose root wrote its figures; a
    cluster restarted alone that could not rejoin before the others finished has none), the first
    that validated of which is fused (`_lead`). `seconds` and `resumed_from` (the step training
    started from) default to what its root recorded."""
    if clusters is None:
        written = set(where.child(CLUSTERS).files())
        clusters = [c.id for c in plan.clusters if f"cluster_{c.id}.json" in written]
    ids = sorted(clusters)
    if not ids:
        raise RavnestError("no cluster finished: nothing to fuse")
    figures = [json.loads(where.child(CLUSTERS).read(f"cluster_{c}.json")) for c in ids]
    lead = _lead(figures)
    figures.insert(0, figures.pop(lead))
    model = building.build_model(job.spec)
    reference = model.state_dict()
    stages = load_stages(where.child(STAGES), ids[lead])  # read once: fused twice, trained and best
    fused = ordered_like(fuse_stages(stages), reference)
    _save(where, OUTPUTS["model"], fused)
    best = None
    try:
        best = ordered_like(fuse_stages(stages, "best"), reference)
        _save(where, OUTPUTS["bestModel"], best)
    except RavnestError as e:
        log.info("no best model: %s", e)
    where.write(OUTPUTS["learningCurve"], curve_csv(figures).encode())
    where.write(OUTPUTS["learningCurvePng"], curve_png(figures, job.name))
    model.load_state_dict(fused)
    fused_metric = evaluate(model, job)
    first = figures[0]
    seconds = first.get("seconds") if seconds is None else seconds
    resumed_from = first.get("resumed_from") or 0 if resumed_from is None else resumed_from
    samples, updates = sum(c["samples"] for c in figures), first["updates"]
    trained = samples * (updates - resumed_from) // updates if updates else 0
    summary = {
        "job": job.name, "plan": plan.fingerprint, "clusters": len(figures),
        "nodes": len(plan.nodes), "updates": updates,
        "samples": samples, "resumed_from_step": resumed_from,
        "samples_trained": trained, "seconds": round(seconds, 3) if seconds else seconds,
        "samples_per_second": round(trained / seconds, 2) if seconds and trained else None,
        "train_loss": next((r["train_loss"] for r in reversed(first["curve"])
                            if "train_loss" in r), None),
        "epoch": first.get("epoch"),
        "val_loss": first["val_loss"], "val_metric": first["val_metric"],
        "fused_val_loss": fused_metric["loss"], "fused_val_metric": fused_metric["metric"],
        "best_step": first["best_step"],
        "rounds_skipped": sum(c["rounds_skipped"] for c in figures),
        "rounds_partial": sum(c.get("rounds_partial", 0) for c in figures),
        "rejoined": {str(c["cluster"]): c["rejoined"] for c in figures if c.get("rejoined")},
        "model": f"{where}/{OUTPUTS['model']}",
        "best_model": f"{where}/{OUTPUTS['bestModel']}" if best is not None else None,
    }
    where.write(OUTPUTS["summary"], json.dumps(summary, indent=1).encode())
    return summary


def _lead(figures: list[dict[str, Any]]) -> int:
    """Which of the clusters' `figures` the job's outputs and summary come from: the first that
    validated. A cluster whose root rejoined only after the final round (restarted too near the
    end) trained no epoch after it took the others' state, so it has no validation, learning
    curve or best weights of its own, though it ends with the same weights as the others."""
    return next((i for i, f in enumerate(figures) if f.get("val_loss") is not None), 0)


def outputs(where: Location, summary: dict[str, Any]) -> dict[str, str]:
    """Where each output is (what `status.outputs` says), the best model only if written."""
    return {"uri": str(where), **{key: f"{where}/{name}" for key, name in OUTPUTS.items()
                                  if key != "bestModel" or summary.get("best_model")}}


CURVE_FIELDS = ["cluster", "epoch", "step", "samples", "train_loss", "val_loss", "val_metric",
                "time"]


def curve_csv(clusters: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=CURVE_FIELDS, lineterminator="\n")
    w.writeheader()
    for c in clusters:
        for row in c["curve"]:
            w.writerow({"cluster": c["cluster"], **row})
    return out.getvalue()


def curve_png(clusters: list[dict[str, Any]], title: str) -> bytes:
    """The learning curve as a PNG: training and validation loss of every cluster per step, and
    the validation metric on a second axis when there is one."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.subplots()
    metric_ax = None
    for c in clusters:
        rows, k = c["curve"], c["cluster"]
        for key, style in (("train_loss", "-"), ("val_loss", "o--")):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                label = f"cluster {k} {key.replace('_', ' ')}"
                ax.plot(*zip(*pts, strict=True), style, label=label)
        metric = [(r["step"], r["val_metric"]) for r in rows if r.get("val_metric") is not None]
        if metric:
            metric_ax = metric_ax or ax.twinx()
            metric_ax.plot(*zip(*metric, strict=True), "s:", color="tab:green",
                           label=f"cluster {k} validation metric")
    ax.set(xlabel="optimizer step", ylabel="loss", title=f"{title}: learning curve")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if metric_ax is not None:
        metric_ax.set_ylabel("validation metric")
        more = metric_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, fontsize="small", loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


@torch.no_grad()
def evaluate(model: torch.nn.Module, job: Job) -> dict[str, float | None]:
    """Validation loss and accuracy of a plain PyTorch model on the job's validation set."""
    spec = job.spec
    _, val = building.build_datasets(spec)
    criterion = building.build_criterion(spec)
    model.eval()
    loss, n, correct, count = 0.0, 0, 0, 0
    loader = torch.utils.data.DataLoader(val, batch_size=spec.data.batch_size)
    for *xs, y in loader:
        out = model(*xs)
        loss += float(criterion(out, y)) * len(y)
        n += len(y)
        mask = y != -100
        correct += int((out.argmax(1) == y)[mask].sum())
        count += int(mask.sum())
    metric = correct / count if spec.training.metric == "accuracy" and count else None
    return {"loss": loss / max(n, 1), "metric": metric}
