"""Processes of their own that claim one checkpoint folder at once (`ravnest.run.owning.claim`),
as two jobs started together would: started once (imports done), let go together per `race()`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLAIMER = """
import json, sys
from ravnest.errors import SpecError
from ravnest.run import owning
from ravnest.spec import parse_job
from ravnest.storing import Options, open_location
args = json.loads(sys.argv[1])
where = open_location(args["uri"], Options(endpoint_url=args.get("endpoint")))
job = parse_job(args["job"])
print("ready", flush=True)
lease = None
for line in sys.stdin:
    if line.strip() == "release":
        if lease is not None:
            lease.release()
            lease = None
        print("{}", flush=True)
        continue
    try:
        lease = owning.claim(where, job)
        print(json.dumps({"won": True}), flush=True)
    except SpecError as e:
        print(json.dumps({"won": False, "why": str(e)}), flush=True)
"""


class Claimers:
    """One process per job document, each claiming `uri` for its job once per `race()`."""

    def __init__(self, uri: str, jobs: list[dict[str, Any]], endpoint: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [
            str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", CLAIMER, json.dumps({"uri": uri, "job": j,
                                                        "endpoint": endpoint})],
            env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for j in jobs]
        for p in self.procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"

    def _all(self, line: str) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in self.procs if p.stdout is not None]

    def race(self) -> list[dict[str, Any]]:
        """Each process's claim, made at once: won, or why not."""
        return self._all("claim\n")

    def release(self) -> None:
        """The winner gives its lease back."""
        self._all("release\n")

    def __enter__(self) -> Claimers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.communicate()
