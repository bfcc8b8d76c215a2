"""The operator's settings: one frozen dataclass, read from the environment in one place.

The chart sets these variables on the operator's Deployment; `Settings.from_env` is the only code
of the operator that reads them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from ravnest.podsecurity import EXEMPTIONS


@dataclass(frozen=True)
class Settings:
    worker_image: str = "ravnest:latest"
    """The worker pods' image (RAVNEST_WORKER_IMAGE); default ravnest:latest."""
    reconcile_interval: float = 2.0
    """Seconds between the ticker's passes over each job (RAVNEST_RECONCILE_INTERVAL); default 2."""
    network_policies: bool = False
    """Whether each job gets a NetworkPolicy (RAVNEST_NETWORK_POLICIES=true); default off."""
    metrics_port: int = 8080
    """TCP port of the operator's own Prometheus metrics (RAVNEST_OPERATOR_METRICS_PORT);
    default 8080."""
    final_scrape_seconds: float = 0.0
    """Seconds a finished worker waits for Prometheus to scrape its final metrics
    (RAVNEST_FINAL_SCRAPE_SECONDS, set by the chart when its PodMonitor is on); default 0, no
    wait."""
    signing_key_file: str = ""
    """A file with the operator's secret key (RAVNEST_SIGNING_KEY_FILE; the chart mounts a Secret
    it makes), from which each job's authority is derived (`ravnest.comm.identity`): with it, the
    operator can issue identities to the nodes of a job that grows after it restarted. Unset: a
    key made at start, so a job planned before a restart cannot grow after it."""
    template_allow: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """namespace ('*': every namespace) -> what its jobs' pod templates may set beyond Pod
    Security's restricted level (names of `ravnest.podsecurity.EXEMPTIONS`), a cluster admin's
    choice (RAVNEST_TEMPLATE_ALLOW, a JSON object of lists; the chart's templatePolicy.allow);
    default none: every namespace's templates are held to it."""

    def allowed(self, namespace: str) -> frozenset[str]:
        """What `namespace`'s pod templates may set beyond the restricted level."""
        return self.template_allow.get("*", frozenset()) | self.template_allow.get(
            namespace, frozenset())

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """The settings the environment gives; an unset variable keeps its default."""
        return cls(
            worker_image=environ.get("RAVNEST_WORKER_IMAGE", cls.worker_image),
            reconcile_interval=float(environ.get("RAVNEST_RECONCILE_INTERVAL",
                                                 cls.reconcile_interval)),
            network_policies=environ.get("RAVNEST_NETWORK_POLICIES", "false") == "true",
            metrics_port=int(environ.get("RAVNEST_OPERATOR_METRICS_PORT", cls.metrics_port)),
            final_scrape_seconds=float(environ.get("RAVNEST_FINAL_SCRAPE_SECONDS") or 0),
            signing_key_file=environ.get("RAVNEST_SIGNING_KEY_FILE", ""),
            template_allow=_template_allow(environ.get("RAVNEST_TEMPLATE_ALLOW") or "{}"))


def _template_allow(text: str) -> dict[str, frozenset[str]]:
    """RAVNEST_TEMPLATE_ALLOW's value; ValueError naming what is wrong, so that the operator
    does not start with a policy it misread."""
    where = "RAVNEST_TEMPLATE_ALLOW"
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(given, dict):
        raise ValueError(f"{where}: must be a JSON object of namespace -> list of names")
    out: dict[str, frozenset[str]] = {}
    for namespace, names in given.items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}[{namespace!r}]: must be a list of names")
        unknown = sorted(set(names) - set(EXEMPTIONS))
        if unknown:
            raise ValueError(f"{where}[{namespace!r}]: unknown {unknown}; the names are "
                             f"{', '.join(EXEMPTIONS)}")
        out[namespace] = frozenset(names)
    return out
