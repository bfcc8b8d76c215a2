"""What a job's pod template (`spec.template`) may set: Pod Security's "restricted" level.

Creating a RavnestJob must never grant more than creating an ordinary, restricted pod: the
operator makes the job's pods with its own service account, so a template that asked for a
privileged container, the host's filesystem or a service-account token would get them with the
operator's rights instead of the user's. The operator's pods already meet the restricted level
(`ravnest_operator.resources`); the template is merged over them key by key (a key it sets wins),
so checking each key the template sets against that level checks the merged pod.

`problems` lists what a template sets beyond it, each with its place in the template. Some of it a
cluster admin may allow for chosen namespaces (the chart's `templatePolicy.allow`, the operator's
RAVNEST_TEMPLATE_ALLOW), by the names in `EXEMPTIONS`; the operator's own label and annotation
keys (`ravnest.io/...`) are never the template's to set. The rules follow
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline and restricted).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from .errors import shown

EXEMPTIONS: dict[str, str] = {
    "privileged": "privileged containers, privilege escalation, an unmasked /proc, SELinux "
                  "options, an unconfined seccomp or AppArmor profile, Windows host processes "
                  "and unsafe sysctls",
    "capabilities": "capabilities added beyond NET_BIND_SERVICE, or ALL not dropped",
    "root": "running as root (runAsUser: 0, runAsNonRoot: false)",
    "hostPath": "hostPath volumes (the node's filesystem)",
    "volumes": "volume types other than configMap, csi, downwardAPI, emptyDir, ephemeral, "
               "persistentVolumeClaim, projected and secret",
    "initContainers": "init containers (they run outside the operator's hardening)",
    "serviceAccountToken": "a mounted service-account token (automountServiceAccountToken: true, "
                           "a projected serviceAccountToken)",
    "scheduling": "tolerating every taint, and the system-node-critical and "
                  "system-cluster-critical priority classes",
}
"""What a cluster admin may allow a namespace's templates beyond the restricted level, by name."""

OPERATOR_KEYS = "ravnest.io/"
"""The prefix of the labels and annotations the operator sets and selects its pods by."""

RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
_PROFILES = ("RuntimeDefault", "Localhost")
_APPARMOR = "container.apparmor.security.beta.kubernetes.io/"
_SECCOMP = ("seccomp.security.alpha.kubernetes.io/pod",
            "container.seccomp.security.alpha.kubernetes.io/")

Loc = tuple[int | str, ...]
Problem = tuple[Loc, str]


def problems(template: Mapping[str, Any], allowed: Collection[str] = ()) -> list[Problem]:
    """What `template` (a pod template as the API spells it: camelCase) sets beyond the
    restricted level and `allowed` does not allow, as (place in the template, message)."""
    out: list[Problem] = []
    for loc, exemption, what in _findings(template):
        if exemption is None:
            out.append((loc, what))
        elif exemption not in allowed:
            out.append((loc, f"{what}: a job's pods are held to Pod Security's restricted level "
                             f"(a cluster admin may allow {exemption!r} for this namespace: the "
                             f"chart's templatePolicy.allow)"))
    return out


def volume_problems(volume: Mapping[str, Any], allowed: Collection[str] = ()) -> list[Problem]:
    """`problems` of one volume the operator mounts in every pod (spec.checkpoint.volume),
    placed in the volume."""
    return [(loc[3:], what) for loc, what in problems({"spec": {"volumes": [volume]}}, allowed)]


def _findings(t: Mapping[str, Any]) -> Iterator[tuple[Loc, str | None, str]]:
    meta = _mapping(t.get("metadata"))
    for part in ("labels", "annotations"):
        for key, value in _mapping(meta.get(part)).items():
            if str(key).startswith(OPERATOR_KEYS):
                yield ("metadata", part, key), None, "keys under ravnest.io/ are the operator's"
            elif part == "annotations":
                yield from _annotation(("metadata", part, key), str(key), value)
    spec = _mapping(t.get("spec"))
    yield from _security(("spec", "securityContext"), _mapping(spec.get("securityContext")),
                         pod=True)
    for i, c in enumerate(_list(spec.get("containers"))):
        csc = _mapping(_mapping(c).get("securityContext"))
        yield from _security(("spec", "containers", i, "securityContext"), csc, pod=False)
    if _list(spec.get("initContainers")):
        yield ("spec", "initContainers"), "initContainers", "init containers are not allowed"
    if spec.get("automountServiceAccountToken") is True:
        yield (("spec", "automountServiceAccountToken"), "serviceAccountToken",
               "a service-account token may not be mounted")
    for i, vol in enumerate(_list(spec.get("volumes"))):
        yield from _volume(("spec", "volumes", i), _mapping(vol))
    for i, tol in enumerate(_list(spec.get("tolerations"))):
        tol = _mapping(tol)
        if not tol.get("key") and tol.get("operator") == "Exists":
            yield (("spec", "tolerations", i), "scheduling",
                   "a toleration of every taint is not allowed")
    priority_class = spec.get("priorityClassName")
    if isinstance(priority_class, str) and priority_class.startswith("system-"):
        yield (("spec", "priorityClassName"), "scheduling",
               f"the priority class {shown(priority_class)} is the cluster's own")


def _annotation(loc: Loc, key: str, value: Any) -> Iterator[tuple[Loc, str | None, str]]:
    value = str(value)
    if key.startswith(_APPARMOR) and value != "runtime/default" and \
            not value.startswith("localhost/"):
        yield loc, "privileged", f"the AppArmor profile {shown(value)} is not allowed"
    if (key == _SECCOMP[0] or key.startswith(_SECCOMP[1])) and value == "unconfined":
        yield loc, "privileged", "an unconfined seccomp profile is not allowed"


def _security(loc: Loc, sc: Mapping[str, Any], pod: bool) -> Iterator[tuple[Loc, str | None, str]]:
    if not pod:
        if sc.get("privileged") is True:
            yield (*loc, "privileged"), "privileged", "a privileged container is not allowed"
        if sc.get("allowPrivilegeEscalation") is True:
            yield ((*loc, "allowPrivilegeEscalation"), "privileged",
                   "privilege escalation is not allowed")
        if sc.get("procMount") not in (None, "Default"):
            yield ((*loc, "procMount"), "privileged",
                   f"procMount {shown(sc['procMount'])} is not allowed (Default only)")
        if "capabilities" in sc:
            caps = _mapping(sc["capabilities"])
            if "ALL" not in _list(caps.get("drop")):
                yield ((*loc, "capabilities", "drop"), "capabilities",
                       "must drop ALL (the operator's pods do)")
            extra = [c for c in _list(caps.get("add")) if c != "NET_BIND_SERVICE"]
            if extra:
                yield ((*loc, "capabilities", "add"), "capabilities",
                       f"adding {shown(extra)} is not allowed (NET_BIND_SERVICE only)")
    if sc.get("runAsNonRoot") is False:
        yield (*loc, "runAsNonRoot"), "root", "running as root is not allowed"
    if "runAsUser" in sc and sc["runAsUser"] == 0:
        yield (*loc, "runAsUser"), "root", "running as uid 0 is not allowed"
    for key in ("seccompProfile", "appArmorProfile"):
        if key in sc:
            kind = _mapping(sc[key]).get("type")
            if kind not in _PROFILES:
                yield ((*loc, key, "type"), "privileged",
                       f"must be RuntimeDefault or Localhost, got {shown(kind)}")
    if "seLinuxOptions" in sc:
        se = _mapping(sc["seLinuxOptions"])
        if se.get("user") or se.get("role") or se.get("type", "") not in SELINUX_TYPES:
            yield ((*loc, "seLinuxOptions"), "privileged",
                   "only a container SELinux type may be set (no user or role)")
    if _mapping(sc.get("windowsOptions")).get("hostProcess") is True:
        yield ((*loc, "windowsOptions", "hostProcess"), "privileged",
               "host processes are not allowed")
    for i, sysctl in enumerate(_list(sc.get("sysctls"))):
        name = _mapping(sysctl).get("name")
        if name not in SAFE_SYSCTLS:
            yield ((*loc, "sysctls", i), "privileged",
                   f"the sysctl {shown(name)} is not one of the safe set")


def _volume(loc: Loc, vol: Mapping[str, Any]) -> Iterator[tuple[Loc, str | None, str]]:
    for kind in sorted(str(k) for k in vol if k != "name"):
        if kind == "hostPath":
            yield (*loc, kind), "hostPath", "a hostPath volume is not allowed"
        elif kind not in RESTRICTED_VOLUMES:
            yield (*loc, kind), "volumes", f"a {kind} volume is not allowed"
    sources = _list(_mapping(vol.get("projected")).get("sources"))
    for i, source in enumerate(sources):
        if "serviceAccountToken" in _mapping(source):
            yield ((*loc, "projected", "sources", i, "serviceAccountToken"),
                   "serviceAccountToken", "a service-account token may not be mounted")


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
