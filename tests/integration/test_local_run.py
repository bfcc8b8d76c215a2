"""The local runner end to end: real worker processes on 127.0.0.1 training the shipped examples."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from processes import pids_with
from scoring import digits_accuracy as accuracy_of

from ravnest import SpecError, WorkerFailed, cli, parse_job, run_job
from ravnest.examples.digits import build_model
from ravnest.run.locking import lock_folder
from ravnest.train.fusing import fuse_stage_files

ROOT = Path(__file__).resolve().parents[2]


def test_readme_command_trains_digits(tmp_path):
    """`ravnest run examples/digits.yaml`: >= 95% accuracy, and the fused model reproduces it."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "ravnest", "run", str(ROOT / "examples" / "digits.yaml"),
         "--output", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clusters"] == 2 and summary["nodes"] == 6
    assert summary["val_metric"] >= 0.95
    state = torch.load(out / "model.pt", weights_only=True)
    assert list(state) == list(build_model().state_dict())
    assert accuracy_of(state) == pytest.approx(summary["val_metric"], abs=1e-6)
    best = torch.load(out / "best_model.pt", weights_only=True)
    assert accuracy_of(best) >= 0.9
    curve = (out / "learning_curve.csv").read_text().splitlines()
    assert curve[0].startswith("cluster,epoch,step")
    assert len(curve) > 100
    assert "val accuracy" in result.stdout
    shown = subprocess.run([sys.executable, "-m", "ravnest", "status", "digits", "-o", str(out)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    updates = summary["updates"]
    epochs = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())["spec"][
        "training"]["epochs"]
    assert shown.stdout.startswith(f"Succeeded [{'#' * 30}] {updates}/{updates} epoch {epochs} ")
    assert f"val {summary['val_metric']:.3f}" in shown.stdout


def _digits(doc, **training):
    doc["spec"]["training"].update(training)
    return doc


def test_async_schedule_trains_digits(tmp_path, digits_doc):
    job = parse_job(_digits(digits_doc, schedule="async", maxInFlight=4))
    summary = run_job(job, tmp_path, progress=False)
    assert summary["val_metric"] >= 0.95
    assert accuracy_of(torch.load(tmp_path / "model.pt", weights_only=True)) >= 0.95


def test_one_cluster_of_seven_stages_with_bf16_on_the_wire(tmp_path, digits_doc):
    digits_doc["spec"]["plan"] = {"clusters": 1}
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 7}]
    _digits(digits_doc, epochs=3, compression="bf16")
    summary = run_job(parse_job(digits_doc), tmp_path, progress=False)
    plan = (tmp_path / "plan.txt").read_text()
    assert plan.count(" stem ") == 5
    assert summary["val_metric"] >= 0.9


def test_torchscript_model_trains_data_parallel(tmp_path, digits_doc):
    script = tmp_path / "digits_scripted.pt"
    torch.jit.save(torch.jit.script(build_model()), script)
    digits_doc["spec"]["model"] = {"torchscript": str(script),
                                   "exampleInput": {"shape": [32, 1, 8, 8]}}
    digits_doc["spec"]["plan"] = {}
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 2}]
    _digits(digits_doc, epochs=3)
    summary = run_job(parse_job(digits_doc), tmp_path / "out", progress=False)
    assert summary["clusters"] == 2 and summary["nodes"] == 2
    assert accuracy_of(torch.load(tmp_path / "out" / "model.pt", weights_only=True)) >= 0.9


def test_clusters_of_one_provider_all_join_the_final_reduce(tmp_path, digits_doc):
    digits_doc["spec"]["plan"] = {"clusters": 3}
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 3}]
    # only the final reduce averages: without it the three copies would differ
    _digits(digits_doc, epochs=2, reduceFactor=100000)
    summary = run_job(parse_job(digits_doc), tmp_path, progress=False)
    assert summary["clusters"] == 3 and summary["val_metric"] >= 0.9
    copies = [fuse_stage_files(tmp_path / "stages", c) for c in range(3)]
    for other in copies[1:]:
        for k, v in copies[0].items():
            torch.testing.assert_close(other[k].float(), v.float(), rtol=0, atol=1e-6)


def test_a_failure_that_repeats_identically_is_reported_not_restarted_again_and_nothing_left(
        tmp_path, digits_doc, worker_env):
    """Issue 19 item 7: restarting cannot cure a worker that fails the same way every time; the
    run stops after the first restart shows it, not after backoffLimit restarts, saying how the
    worker failed, and leaves no process running. (Which failure is taken for a repeat, and what
    is said, are decided in `supervising.after_loss`: tests/unit/test_supervising.py.)"""
    digits_doc["spec"]["data"]["entrypoint"] = "models:data_missing_on_providers"
    digits_doc["spec"]["runPolicy"] = {"backoffLimit": 3}
    with pytest.raises(WorkerFailed) as err:
        run_job(parse_job(digits_doc), tmp_path, progress=False)
    message = str(err.value)
    # a worker exits 2 on a spec error, which names the field
    assert "exited with code 2 after 1 restart(s), backoffLimit 3; it failed the same way" \
        in message, message
    assert "spec.data.entrypoint" in message and "dataset shard missing" in message
    assert json.loads((tmp_path / "status.json").read_text())["restarts"] == 1
    assert pids_with(str(tmp_path)) == []


def test_broken_data_fails_before_any_worker_starts(tmp_path, digits_doc, worker_env):
    """The datasets are built once before the workers start (issue 19 item 7)."""
    digits_doc["spec"]["data"]["entrypoint"] = "models:broken_data"
    digits_doc["spec"]["runPolicy"] = {"backoffLimit": 1}
    with pytest.raises(SpecError) as err:
        run_job(parse_job(digits_doc), tmp_path, progress=False)
    message = str(err.value)
    assert "spec.data.entrypoint" in message and "dataset shard missing" in message
    assert not list(tmp_path.glob("logs/*.log")) and pids_with(str(tmp_path)) == []


BAD = [
    ("providers[0].ram", -1, "spec.providers[0].ram: must be a positive quantity, got -1"),
    ("training.optimizer.name", "Adamm",
     "spec.training.optimizer.name: must be a torch.optim optimizer such as 'Adam', got 'Adamm'"),
    ("model.entrypoint", "no_such_module:build",
     "spec.model.entrypoint: cannot import module 'no_such_module'"),
    ("providers", [{"ram": "1Ki", "replicas": 2}],
     "spec.providers: total RAM 1.91e-06 GB is below the model's training memory"),
    ("providers", [{"ram": 4, "replicas": 40}],
     "more stages than layers"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_job_gives_one_clear_error_and_starts_nothing(tmp_path, digits_doc, capsys, path,
                                                          value, message):
    """`ravnest run` of a bad job: a non-zero exit, the path-qualified error on stderr, no
    traceback and no run folder. Each case runs `cli.main` in this process (the same code as the
    command, without a Python start and a torch import per case: ~7 s each); the first runs the
    command itself too, as a user does."""
    node = digits_doc["spec"]
    *parents, last = path.replace("[0]", ".0").split(".")
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[last] = value
    if path == "providers" and value[0].get("replicas") == 40:
        digits_doc["spec"]["plan"] = {"clusters": 1}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(digits_doc))
    out = tmp_path / "out"
    code = cli.main(["run", str(job_file), "-o", str(out)])
    stderr = capsys.readouterr().err
    assert code != 0
    assert message in stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    if path == BAD[0][0]:
        result = subprocess.run([sys.executable, "-m", "ravnest", "run", str(job_file), "-o",
                                 str(out)], capture_output=True, text=True, timeout=120)
        assert result.returncode == code
        assert message in result.stderr
        assert "Traceback" not in result.stderr
        assert not out.exists()


def test_sorter_transformer_example_learns_to_sort(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "sorter.yaml").read_text())
    doc["spec"]["training"]["epochs"] = 3
    summary = run_job(parse_job(doc), tmp_path, progress=False)
    assert summary["fused_val_metric"] >= 0.95


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_mode, p.stat().st_mtime_ns,
                                         p.read_bytes() if p.is_file() else b"")
            for p in sorted(folder.rglob("*"))}


def test_a_second_run_into_a_folder_in_use_is_refused_and_changes_nothing(tmp_path, digits_doc):
    """Two runs into one folder rewrote each other's files: the second is refused at once,
    naming the run that holds the folder."""
    digits_doc["spec"]["training"]["epochs"] = 1
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(digits_doc))
    out = tmp_path / "out"
    held = lock_folder(out)
    try:
        (out / "status.json").write_text('{"job": "digits", "phase": "Running"}')
        (out / "nodes").mkdir()
        (out / "nodes" / "node_0.json").write_text("{}")
        before = _snapshot(out)
        result = subprocess.run([sys.executable, "-m", "ravnest", "run", str(job_file), "-o",
                                 str(out), "--no-progress"], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 1
        assert f"{out} is in use by another run (pid {os.getpid()}, started " in result.stderr
        assert "Traceback" not in result.stderr
        assert _snapshot(out) == before
    finally:
        os.close(held)


def test_a_run_folder_is_readable_by_its_owner_only_and_a_rerun_trains_nothing(tmp_path,
                                                                             digits_doc):
    """Weights, logs, checkpoints, node files and TLS keys were 0644 in 0755 folders: readable
    by every local user. Now nothing under the folder grants group or others any access, after
    a second run into it too.

    Issue 19 item 10: that second `ravnest run` into the finished folder resumes at the end; it
    must not report a throughput for work it did not do."""
    digits_doc["spec"]["training"]["epochs"] = 1
    digits_doc["spec"]["security"] = {"tls": True}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(digits_doc))
    out = tmp_path / "runs" / "out"
    runs = [subprocess.run([sys.executable, "-m", "ravnest", "run", str(job_file), "-o",
                            str(out), "--no-progress"], capture_output=True, text=True,
                           timeout=900, umask=0o022) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-3000:]
    paths = [out, *out.rglob("*")]
    assert {"model.pt", "summary.json", "status.json", "stages", "checkpoints", "logs",
            "tls"} <= {p.name for p in paths}
    shared = [f"{oct(p.stat().st_mode & 0o777)} {p}" for p in paths if p.stat().st_mode & 0o077]
    assert shared == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == summary["updates"] > 0
    assert summary["samples_trained"] == 0 and summary["samples_per_second"] is None
    assert "nothing left to train" in runs[1].stdout
    assert "samples/s" in runs[0].stdout and "nothing left" not in runs[0].stdout


def test_a_run_larger_than_the_machine_is_warned_about(tmp_path, digits_doc, caplog):
    """Issue 19 item 9: more workers than this machine's memory holds get a warning before any
    starts (the pool is sized from the machine, so this holds on any machine)."""
    from ravnest.run.local import WORKER_BASE_BYTES, LocalRun

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    count = physical // WORKER_BASE_BYTES + 1
    digits_doc["spec"]["providers"] = [{"ram": 4, "bandwidth": 100, "replicas": int(count)}]
    digits_doc["spec"]["plan"] = {"clusters": -(-int(count) // 8)}  # 8 stages each
    digits_doc["spec"]["data"]["batchSize"] = 8  # so that every cluster gets a batch
    run = LocalRun(parse_job(digits_doc), tmp_path / "run", progress=False)
    with caplog.at_level(logging.WARNING, logger="ravnest.run.local"):
        metas = run.prepare()
    run.release()
    assert len(metas) == count
    assert any(f"{count} workers need an estimated" in r.getMessage() and "spec.providers" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert pids_with(str(tmp_path)) == []


def test_providers_on_hosts_of_their_own_train_over_tls(tmp_path, digits_doc):
    """`LocalRun.host` / `LocalRun.launch` (what bench/bandwidth.py uses to put each provider in a
    network namespace of its own): every worker listens on its provider's address, is reached
    there by its peers over mutual TLS (its certificate names that address), and the run trains
    as on 127.0.0.1. Here the hosts are other loopback addresses, 127.0.1.(i+1)."""
    from cryptography import x509

    from ravnest.comm.tls import CERT_FILE, identity
    from ravnest.run.local import LocalRun
    from ravnest.run.metadata import NodeMetadata, host_of

    launched: list[int] = []

    class Placed(LocalRun):
        def host(self, provider: int) -> str:
            return f"127.0.1.{provider + 1}"

        def launch(self, provider: int, argv: list[str]) -> list[str]:
            launched.append(provider)
            return argv

    digits_doc["spec"]["training"]["epochs"] = 1
    digits_doc["spec"]["security"] = {"tls": True}
    digits_doc["spec"]["plan"] = {"clusters": 2}
    digits_doc["spec"]["providers"] = [{"ram": 4, "bandwidth": 1000}] * 4
    digits_doc["spec"].pop("checkpoint")
    run = Placed(parse_job(digits_doc), tmp_path / "run", progress=False)
    summary = run.run()
    assert run.plan is not None
    assert sorted(launched) == [0, 1, 2, 3]
    assert summary["clusters"] == 2 and summary["val_metric"] >= 0.8
    for node in run.plan.nodes:
        meta = NodeMetadata.load(tmp_path / "run" / "nodes" / f"{node.name}.json")
        host = f"127.0.1.{node.provider + 1}"
        assert host_of(meta.listen) == host and host_of(meta.addresses[node.name]) == host
        cert = x509.load_pem_x509_certificate(
            (tmp_path / "run" / "tls" / identity(node.name) / CERT_FILE).read_bytes())
        ips = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert host in {str(ip) for ip in ips.get_values_for_type(x509.IPAddress)}
