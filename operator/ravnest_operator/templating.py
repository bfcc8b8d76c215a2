"""A job's pod template (`spec.template`) merged over the pods the operator builds.

The rules, the same for worker and planner pods:
- metadata labels and annotations are added; the operator's own keys win (selectors and the
  plan's fingerprint depend on them);
- the template's container (`ravnest`) merges into the job's container: env by name (the
  template's wins), envFrom, volumeMounts and volumeDevices added, a worker's resources' requests
  and limits merged key by key (the template's win, e.g. `nvidia.com/gpu: 1` or more memory; the
  planner's are spec.plan.resources alone),
  securityContext merged key by key, imagePullPolicy and workingDir set;
- pod lists (initContainers, volumes, tolerations, imagePullSecrets, topologySpreadConstraints,
  hostAliases) are added to the operator's; nodeSelector is merged under a provider's own;
  securityContext is merged key by key; any other field (serviceAccountName, affinity,
  priorityClassName, automountServiceAccountToken, ...) is set as given.
So the operator's hardening (non-root, read-only root filesystem, no capabilities, seccomp, no
service-account token) stays unless the template sets one of those keys itself. What a template
may not set (hostname, restartPolicy, the container's command, the operator's volume names) is
refused when the job is validated (`ravnest.spec.PodTemplate`).
"""

from __future__ import annotations

import copy
from typing import Any

from ravnest.spec import PodTemplate

_LISTS = ("initContainers", "volumes", "tolerations", "imagePullSecrets",
          "topologySpreadConstraints", "hostAliases")


def merged(pod: dict[str, Any], template: PodTemplate | None,
           resources: bool = True) -> dict[str, Any]:
    """`pod` with `template` merged over it (a new dict; `pod` is left as it was). Without
    `resources` the container's resources are left alone: the planner pod's come from
    spec.plan.resources, and it needs no GPU the workers ask for."""
    if template is None:
        return pod
    out = copy.deepcopy(pod)
    t = template.model_dump(by_alias=True, exclude_none=True)
    if not resources:
        for c in t.get("spec", {}).get("containers", []):
            c.pop("resources", None)
    meta = out["metadata"]
    for key in ("labels", "annotations"):
        if t.get("metadata", {}).get(key):
            meta[key] = {**t["metadata"][key], **(meta.get(key) or {})}
    spec, tspec = out["spec"], copy.deepcopy(t.get("spec", {}))
    for c in tspec.pop("containers", []):
        _container(spec["containers"][0], c)
    for key in _LISTS:
        if key in tspec:
            spec[key] = [*(spec.get(key) or []), *tspec.pop(key)]
    if "nodeSelector" in tspec:
        spec["nodeSelector"] = {**tspec.pop("nodeSelector"), **(spec.get("nodeSelector") or {})}
    if "securityContext" in tspec:
        spec["securityContext"] = {**(spec.get("securityContext") or {}),
                                   **tspec.pop("securityContext")}
    spec.update(tspec)
    return out


def _container(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    theirs = {k: v for k, v in theirs.items() if k != "name"}
    env = {e["name"]: e for e in ours.get("env") or []}
    env.update({e["name"]: e for e in theirs.pop("env", [])})
    if env:
        ours["env"] = list(env.values())
    for key in ("envFrom", "volumeMounts", "volumeDevices"):
        if key in theirs:
            ours[key] = [*(ours.get(key) or []), *theirs.pop(key)]
    if "resources" in theirs:
        res, add = dict(ours.get("resources") or {}), theirs.pop("resources")
        for part in set(res) | set(add):
            if isinstance(add.get(part), dict) or isinstance(res.get(part), dict):
                res[part] = {**(res.get(part) or {}), **(add.get(part) or {})}
            elif part in add:
                res[part] = add[part]
        ours["resources"] = res
    if "securityContext" in theirs:
        ours["securityContext"] = {**(ours.get("securityContext") or {}),
                                   **theirs.pop("securityContext")}
    ours.update(theirs)
