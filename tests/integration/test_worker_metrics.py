"""Every worker serves Prometheus metrics while it trains; controls forged by a holder of the
job's token do not reach its membership (issue 40, without TLS)."""

from __future__ import annotations

import time
import urllib.request

from forging import forge_controls
from prometheus_client.parser import text_string_to_metric_families

from ravnest import parse_job
from ravnest.run.local import LocalRun

EXPECTED = {
    "ravnest_steps", "ravnest_samples", "ravnest_loss", "ravnest_validation_loss",
    "ravnest_validation_metric", "ravnest_epoch", "ravnest_step", "ravnest_total_steps",
    "ravnest_inflight_microbatches", "ravnest_step_duration_seconds",
    "ravnest_forward_duration_seconds", "ravnest_backward_duration_seconds",
    "ravnest_allreduce_duration_seconds", "ravnest_reduce_rounds",
    "ravnest_reduce_rounds_skipped", "ravnest_reduce_rounds_partial",
    "ravnest_ring_members_missing", "ravnest_clusters_active", "ravnest_recoveries",
    "ravnest_recovery_duration_seconds", "ravnest_recovery_bytes", "ravnest_peer_errors",
    "ravnest_sent_bytes",
    "ravnest_received_bytes", "ravnest_checkpoint_step", "ravnest_finished",
    "ravnest_device_memory_peak_bytes",
}


def families(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def test_workers_export_training_metrics(tmp_path, digits_doc):
    digits_doc["spec"]["training"]["epochs"] = 3
    run = LocalRun(parse_job(digits_doc), tmp_path, progress=False)
    metas = run.prepare()
    try:
        run.start(metas)
        root = next(m for m in metas if m.node == run.plan.clusters[0].nodes[0])
        leaf = next(m for m in metas if m.node == run.plan.clusters[0].nodes[-1])
        deadline = time.monotonic() + 180
        seen = {}
        while time.monotonic() < deadline:
            try:
                seen = families(root.metrics_port)
            except OSError:
                time.sleep(0.5)
                continue
            steps = [s for s in seen["ravnest_steps"].samples if s.name.endswith("_total")]
            if steps and steps[0].value >= 20:
                break
            time.sleep(0.5)
        assert EXPECTED <= set(seen), EXPECTED - set(seen)
        assert seen["ravnest_device_memory_peak_bytes"].samples[0].value == 0  # (a CPU stage)
        step = next(s for s in seen["ravnest_steps"].samples if s.name == "ravnest_steps_total")
        assert step.value >= 20
        assert step.labels == {"job": "digits", "namespace": "default", "node": root.node,
                               "role": "root", "cluster": "0", "stage": "0"}
        sent = {s.labels["kind"]: s.value for s in seen["ravnest_sent_bytes"].samples
                if s.name == "ravnest_sent_bytes_total"}
        assert sent["forward"] > 0
        leaf_metrics = families(leaf.metrics_port)
        got = {s.labels["kind"]: s.value for s in leaf_metrics["ravnest_received_bytes"].samples
               if s.name == "ravnest_received_bytes_total"}
        assert got["forward"] > 0
        loss = seen["ravnest_loss"].samples[0].value
        assert 0 < loss < 5
        forge_controls(run, root.node, root.listen)  # (issue 40, without TLS)
        assert run.wait().done, "a worker died"
    finally:
        run.stop()
        run.release()  # (its fork server, lock and lease: what `ravnest run` lets go of)
    log = (tmp_path / "logs" / f"{root.node}.log").read_text()
    assert "dropped: a node speaks for itself only" in log
    assert "skipped" not in log and "introduced itself" not in log
