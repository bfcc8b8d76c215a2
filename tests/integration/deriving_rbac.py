"""The RBAC a program's Kubernetes API calls need, derived from its code, for checking a chart's
roles against it both ways (tests/integration/test_chart.py).

Every kubernetes client method a module names (called or passed around) maps to the (apiGroup,
resource, verb) its endpoint needs, read from the client's generated `_<method>_serialize` code;
arguments that name what a call acts on (a custom resource's group and plural) are resolved from
the module's constants and from names it imports from its own package. kopf's event helpers need
`events/create`; what kopf itself does beyond the handlers' calls is listed by hand (KOPF_NEEDS).
A test tool, not part of the operator: it reads the operator's source, the operator never runs it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import kubernetes.client

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "ravnest_operator"

Triple = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# What kopf itself does beyond the handlers' own calls (kopf/_cogs/clients/{fetching,watching,
# patching,events}.py, kopf/_core/reactor/observation.py):
KOPF_NEEDS: set[Triple] = {
    # watching the served resource: a list, then a watch from its resourceVersion
    ("ravnest.io", "ravnestjobs", "list"), ("ravnest.io", "ravnestjobs", "watch"),
    # its progress and last-handled-configuration annotations, merge-patched on the object
    ("ravnest.io", "ravnestjobs", "patch"),
    # the handlers' patch.status, sent to the status subresource (the CRD has one)
    ("ravnest.io", "ravnestjobs/status", "patch"),
    # the jobs' pods, watched by label for handling.on_pod (a list, then a watch)
    ("", "pods", "list"), ("", "pods", "watch"),
    # handler failures and kopf.info/warn/event are posted as core v1 Events
    ("", "events", "create"),
    # the resource observer lists and watches CRDs to notice served resources (dis)appearing
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}
# Only with --namespace (not --all-namespaces): kopf's namespace observer lists and watches the
# namespaces to match them against the given patterns.
KOPF_NAMESPACE_NEEDS: set[Triple] = {("", "namespaces", "list"), ("", "namespaces", "watch")}
# Kubernetes itself: the operator creates objects with ownerReferences[].blockOwnerDeletion=true,
# which the OwnerReferencesPermissionEnforcement admission plugin allows only to a user who may
# update the owner's finalizers (test_operator_runs_under_chart_rbac turns that plugin on).
ADMISSION_NEEDS: set[Triple] = {("ravnest.io", "ravnestjobs/finalizers", "update")}
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces"}


def _leader_needs() -> set[Triple]:
    """What leader election needs in the release namespace (operator/ravnest_operator/leading.py
    runs the kubernetes client's LeaseLock): derived from that module, as the operator's are."""
    from kubernetes.leaderelection.resourcelock import leaselock

    return api_permissions([Path(leaselock.__file__)], "")[0]
# Non-resource URLs every authenticated user may GET (the default system:public-info-viewer role).
PUBLIC_URLS = {"/version", "/version/", "/healthz", "/livez", "/readyz"}
# kopf's helpers that post an Event for the object.
KOPF_EVENT_FUNCS = {"event", "info", "warn", "exception"}

_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update"}
_SERIALIZE = re.compile(r"method='(\w+)',\s*resource_path='([^']+)'")


@functools.cache
def _api_classes() -> tuple[type, ...]:
    """The kubernetes client's API classes (the package loads them lazily, by __all__)."""
    return tuple(getattr(kubernetes.client, name) for name in kubernetes.client.__all__
                 if name.endswith("Api"))


# Client methods of one name in several API classes, and the class the operator calls it on.
CALLED_ON = {
    # handling._post_event posts core v1 Events (as kopf does); EventsV1Api has one too
    "create_namespaced_event": "CoreV1Api",
}


@functools.cache
def _endpoint(method: str) -> tuple[type, str, str]:
    """(API class, HTTP method, path template) of a kubernetes client method, from the code the
    client generates for it (`_<method>_serialize`)."""
    found = set()
    for cls in _api_classes():
        if method in CALLED_ON and cls.__name__ != CALLED_ON[method]:
            continue
        serialize = getattr(cls, f"_{method}_serialize", None)
        if serialize is not None:
            found |= {(cls, *m) for m in _SERIALIZE.findall(inspect.getsource(serialize))}
    assert len(found) == 1, f"cannot tell the endpoint of kubernetes client .{method}: {found}"
    return found.pop()


@functools.cache
def _client_methods() -> frozenset[str]:
    methods = frozenset(name for cls in _api_classes() for name in vars(cls)
                        if hasattr(cls, f"_{name}_serialize"))
    assert "create_namespaced_pod" in methods, "the kubernetes client's layout changed"
    return methods


def _constants(tree: ast.Module, package: str) -> dict[str, Any]:
    """Module-level string constants and names imported from the package's own modules."""
    out: dict[str, Any] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            module = importlib.import_module(f"{package}.{node.module}")
            out.update({a.asname or a.name: getattr(module, a.name) for a in node.names})
    return out


def _permission(method: str, call: ast.Call | None, consts: dict[str, Any],
                where: str) -> Triple | str:
    """The RBAC (group, resource, verb) one client method needs, or its non-resource URL."""
    cls, http, path = _endpoint(method)
    args: dict[str, Any] = {}
    if call is not None:
        params = [p for p in inspect.signature(getattr(cls, method)).parameters if p != "self"]
        pairs = [*zip(params, call.args, strict=False),
                 *((k.arg, k.value) for k in call.keywords if k.arg)]
        for name, node in pairs:
            if isinstance(node, ast.Constant):
                args[name] = node.value
            elif isinstance(node, ast.Name) and node.id in consts:
                args[name] = consts[node.id]
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return path
    if rest[:2] == ["namespaces", "{namespace}"]:
        rest = rest[2:]

    def resolve(part: str) -> str:
        if part.startswith("{"):
            value = args.get(part.strip("{}"))
            assert isinstance(value, str), (
                f"{where}: .{method} needs {part} to name what it acts on, and it is not a "
                f"constant this test can resolve")
            return value
        return part

    group, resource = resolve(group), resolve(rest[0])
    named = len(rest) > 1
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if http == "GET":
        verb = "get" if named else "list"
    elif http == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS[http]
    return group, resource, verb


def api_permissions(files: Iterable[Path], package: str) -> tuple[set[Triple], set[str]]:
    """What the code's Kubernetes API calls need: every kubernetes client method it names (called
    or passed around) and every kopf event helper; returns (triples, non-resource URLs)."""
    methods = _client_methods()
    triples: set[Triple] = set()
    urls: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        consts = _constants(tree, package)
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if (node.attr in KOPF_EVENT_FUNCS and isinstance(node.value, ast.Name)
                    and node.value.id == "kopf"):
                triples.add(("", "events", "create"))
            elif node.attr in methods:
                need = _permission(node.attr, calls.get(id(node)), consts,
                                   f"{path.name}:{node.lineno}")
                if isinstance(need, str):
                    urls.add(need)
                else:
                    triples.add(need)
    return triples, urls


def granted(rules: list[dict[str, Any]], named: bool = False) -> set[Triple]:
    """The (apiGroup, resource, verb) triples rules grant, refusing wildcards, non-resource URLs
    and, unless `named`, rules held to resourceNames (which grant less than their triples)."""
    out: set[Triple] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule, rule
        assert named or "resourceNames" not in rule, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {rule}"
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}
    return out


def diff(needed: set[Triple], got: set[Triple]) -> str:
    return f"missing: {sorted(needed - got)}\nnot needed: {sorted(got - needed)}"


@functools.cache
def operator_needs() -> tuple[frozenset[Triple], frozenset[str]]:
    triples, urls = api_permissions(sorted(OPERATOR.glob("*.py")), "ravnest_operator")
    return frozenset(triples), frozenset(urls)


LEADER_NEEDS: set[Triple] = _leader_needs()
