"""A worker that fails says why where Kubernetes keeps it (its container's termination message),
since the operator replaces the pod and its log goes with it (where the message goes and how it is
read: tests/unit/test_termination.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ravnest.termination import TERMINATION_LOG_ENV

ROOT = Path(__file__).resolve().parents[2]


def _worker(metadata: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != TERMINATION_LOG_ENV}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "worker"),
                                                          os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "ravnest", "worker", "--metadata", str(metadata)],
                          capture_output=True, text=True, timeout=300, env={**environ, **env})


def test_a_failing_worker_leaves_why_as_its_termination_message(tmp_path: Path) -> None:
    metadata = tmp_path / "node.json"
    metadata.write_text('{"kind": "SomethingElse"}')
    message = tmp_path / "termination-log"
    out = _worker(metadata, **{TERMINATION_LOG_ENV: str(message)})
    assert out.returncode == 2, out.stderr
    said = message.read_text()
    assert said.startswith("SpecError: ") and f"{metadata}: kind: expected" in said, said
    assert f"{metadata}: kind: expected" in out.stderr  # (and the log says it as before)

