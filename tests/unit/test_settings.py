"""A node's training settings are derived from the job spec's models: one mapping, the spec's
defaults, for the worker and for the seed API alike."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from ravnest import parse_job
from ravnest.errors import SpecError
from ravnest.seed.trainer import Trainer
from ravnest.spec import CheckpointSpec, OuterSpec, TrainingSpec, parse_section
from ravnest.train.settings import Settings


def test_the_default_settings_are_those_of_a_default_job(digits_doc) -> None:
    digits_doc["spec"] = {k: digits_doc["spec"][k] for k in ("model", "data", "providers")}
    digits_doc["spec"]["data"] = {"entrypoint": digits_doc["spec"]["data"]["entrypoint"]}
    spec = parse_job(digits_doc).spec
    assert spec.training == TrainingSpec() and spec.checkpoint == CheckpointSpec()
    assert Settings.from_spec(spec, None) == Settings()
    assert Settings.of(TrainingSpec(), 64, 1) == Settings()


def test_every_training_option_of_a_job_reaches_the_settings(digits_doc) -> None:
    digits_doc["spec"]["data"].update(batchSize=48, microbatches=3)
    digits_doc["spec"]["training"] = {
        "epochs": 5, "updateFrequency": 2, "reduceFactor": 3, "averageOptimizer": True,
        "outer": {"optimizer": "sgd", "lr": 0.5, "momentum": 0.5},
        "compression": "fp16", "schedule": "async", "maxInFlight": 6, "validationFrequency": 2,
        "validationSmoothing": 0.5, "gradientClipping": {"maxNorm": 1.5},
        "reduceTimeoutSeconds": 12, "metric": "none", "precision": "bf16",
        "lrScheduler": {"name": "StepLR", "params": {"step_size": 1}, "stepOn": "step"}}
    digits_doc["spec"]["checkpoint"] = {"everySteps": 7, "keep": 4}
    settings = Settings.from_spec(parse_job(digits_doc).spec, "/ckpt", device="cuda:1")
    assert settings == Settings(
        epochs=5, batch_size=48, microbatches=3, update_frequency=2, reduce_factor=3,
        average_optimizer=True, outer=OuterSpec(optimizer="sgd", lr=0.5, momentum=0.5),
        schedule="async", max_in_flight=6, validation_frequency=2,
        validation_smoothing=0.5, clip_norm=1.5, reduce_timeout=12.0, peer_timeout=300.0,
        metric="none", compression="fp16", scheduler_step_on="step", checkpoint_dir="/ckpt",
        checkpoint_every=7, checkpoint_keep=4, precision="bf16", device="cuda:1")
    assert {f.name for f in fields(Settings) if getattr(settings, f.name) == getattr(
        Settings(), f.name)} == {"peer_timeout", "reduce_each_epoch",
                                 "loss_as_given"}  # not job options (the seed API's)


def _seed_node(root: bool, **training: object) -> SimpleNamespace:
    return SimpleNamespace(me=SimpleNamespace(is_root=root), microbatches=2,
                           lr_step_on_epoch_change=False,
                           training=parse_section(TrainingSpec, training))


def test_the_seed_api_builds_its_settings_through_the_spec_models() -> None:
    node = _seed_node(True, update_frequency=2, reduce_factor=2**62, compression="bf16")
    trainer = Trainer(node=node, train_loader=[], val_loader=[], val_freq=3, epochs=4,
                      batch_size=32)
    assert trainer._settings() == Settings(
        epochs=4, batch_size=32, microbatches=2, update_frequency=2, reduce_factor=2**62,
        validation_frequency=3, compression="bf16", scheduler_step_on="step",
        loss_as_given=True)
    alone = Trainer(node=node, train_loader=[], epochs=4, batch_size=32)._settings()
    assert alone.validation_frequency == 2**62 and alone.metric == "none"
    diloco = Trainer(node=_seed_node(True, outer={"lr": 0.5}), epochs=1)._settings()
    assert diloco.outer == OuterSpec(optimizer="nesterov", lr=0.5, momentum=0.9)
    stem = Trainer(node=_seed_node(False), epochs=1)._settings()
    assert stem.metric == "accuracy" and stem.validation_frequency == 1
    with pytest.raises(SpecError, match="Trainer: epochs=0: expected a whole number, 1 or more"):
        Trainer(node=node, train_loader=[], epochs=0)._settings()
