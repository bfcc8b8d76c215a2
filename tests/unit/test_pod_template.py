"""`spec.template` merged over the job's worker and planner pods: what users expect of a pod
template (env, envFrom, imagePullSecrets, serviceAccountName, scheduling, volumes, extended
resources) lands on both, the operator's hardening and own fields stay unless a key is set
explicitly, and what a template may not set is refused by path when the job is validated."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest import parse_job, plan_job, podsecurity
from ravnest.errors import SpecError
from ravnest_operator import resources
from ravnest_operator.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OWNER = resources.Owner("digits", "team-a", "uid-12345678")
TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "vision"},
                 "annotations": {"cost-center": "42"}},
    "spec": {
        "containers": [{"name": "ravnest",
                        "env": [{"name": "HF_HOME", "value": "/cache"}],
                        "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
                        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}},
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                        "securityContext": {"readOnlyRootFilesystem": False}}],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "trainer",
        "nodeSelector": {"gpu": "a100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {}},
        "priorityClassName": "research",
    },
}


def _job(template: Any = None, allow: Any = (), **spec: Any):
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"].update(spec)
    if template is not None:
        doc["spec"]["template"] = template
    return parse_job(doc, template_allow=allow)


@pytest.fixture(scope="module")
def pods() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    plain = _job()
    plan = plan_job(plain)[0]
    job = _job(TEMPLATE)
    bare = resources.pod(OWNER, plain, plan, plan.nodes[0], "ravnest:test")
    return (bare, resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test"),
            resources.planner_pod(OWNER, job, "ravnest:test"))


def test_the_template_lands_on_worker_and_planner_pods(pods):
    _, worker, planner = pods
    for pod in (worker, planner):
        spec, (c,) = pod["spec"], pod["spec"]["containers"]
        assert pod["metadata"]["labels"]["team"] == "vision"
        assert pod["metadata"]["labels"]["ravnest.io/job"] == "digits"
        assert pod["metadata"]["annotations"]["cost-center"] == "42"
        assert {"name": "HF_HOME", "value": "/cache"} in c["env"]
        assert c["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
        assert {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in \
            spec["volumes"]
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert spec["serviceAccountName"] == "trainer"
        assert spec["nodeSelector"] == {"gpu": "a100"}
        assert spec["tolerations"][-1]["key"] == "gpu"
        assert spec["priorityClassName"] == "research" and spec["affinity"]
        # the operator's own fields and the hardening the template did not name stay
        assert c["command"] == ["ravnest"] and spec["restartPolicy"] == "Never"
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": False,
                                        "capabilities": {"drop": ["ALL"]}}
    # a worker's resources merged key by key; the planner's are spec.plan.resources alone
    limits = worker["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1, "memory": "16Gi"}
    assert worker["spec"]["containers"][0]["resources"]["requests"]["memory"].endswith("Mi")
    assert planner["spec"]["containers"][0]["resources"] == resources.PLANNER_RESOURCES
    assert any(e["name"] == "RAVNEST_TOKEN" for e in worker["spec"]["containers"][0]["env"])


def test_without_a_template_the_pod_is_the_operators_own(pods):
    bare, worker, _ = pods
    assert "team" not in bare["metadata"]["labels"]
    assert bare["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert "serviceAccountName" not in bare["spec"]
    assert len(worker["spec"]["volumes"]) == len(bare["spec"]["volumes"]) + 1


def test_a_provider_node_selector_wins_over_the_templates():
    job = _job({"spec": {"nodeSelector": {"gpu": "a100", "zone": "b"}}},
               providers=[{"ram": 4, "replicas": 2, "nodeSelector": {"gpu": "h100"}}])
    plan = plan_job(job)[0]
    pod = resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test")
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100", "zone": "b"}


@pytest.mark.parametrize(("template", "says"), [
    ({"spec": {"containers": [{"name": "ravnest", "command": ["sh"]}]}},
     "spec.template.spec.containers[0].command: not a field a pod template may set"),
    ({"spec": {"hostname": "x"}}, "spec.template.spec.hostname: not a field a pod template"),
    ({"spec": {"restartPolicy": "Always"}}, "spec.template.spec.restartPolicy: not a field"),
    ({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}},
     "spec.template.spec.volumes: volumes[0]: the name 'data' is the operator's"),
    ({"spec": {"containers": [{"volumeMounts": [{"name": "x", "mountPath": "/tmp/"}]}]}},
     "volumeMounts[0]: /tmp is mounted by the operator"),
    ({"spec": {"containers": [{"env": [{"name": "RAVNEST_TOKEN", "value": "x"}]}]}},
     "env[0]: RAVNEST_TOKEN is set by the operator"),
    ({"spec": {"containers": [{"name": "sidecar"}]}},
     "spec.template.spec.containers[0].name: must be 'ravnest'"),
    ({"spec": {"containers": [{}, {}]}}, "spec.template.spec.containers"),
    ({"spec": {"nodeSelector": {"gpu": 1}}}, "spec.template.spec.nodeSelector.gpu"),
    ({"spec": "nope"}, "spec.template.spec"),
])
def test_what_a_template_may_not_set_is_refused_by_path(template, says):
    with pytest.raises(SpecError) as e:
        _job(template)
    assert any(says in p for p in e.value.problems), e.value.problems


def test_the_reserved_names_are_the_ones_the_operator_uses():
    """The spec layer cannot import the operator, so it lists the volume names and mount paths a
    template may not take (spec.RESERVED_VOLUMES / RESERVED_MOUNTS): they must cover every one the
    operator's worker (with TLS) and planner pods use."""
    from ravnest import storing
    from ravnest.spec import RESERVED_MOUNTS, RESERVED_VOLUMES

    job = _job(security={"tls": True}, checkpoint={"path": "pvc://ckpt/a"},
               output={"uri": "pvc://models/b"})
    plan = plan_job(job)[0]
    for pod in (resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test"),
                resources.planner_pod(OWNER, job, "ravnest:test")):
        assert {v["name"] for v in pod["spec"]["volumes"]} <= set(RESERVED_VOLUMES)
        for m in pod["spec"]["containers"][0]["volumeMounts"]:
            path = m["mountPath"]
            assert path in RESERVED_MOUNTS or path.rsplit("/", 1)[0] == storing.PVC_ROOT, path


def test_workers_and_the_planner_reach_the_jobs_storage():
    """s3:// credentials come from the named Secret (the operator never reads it); each claim
    named by a pvc:// location is mounted once where the worker resolves it."""
    from ravnest import storing

    job = _job(checkpoint={"path": "pvc://ckpt/digits"}, output={"uri": "pvc://ckpt/models"},
               storage={"s3": {"credentialsSecret": "s3-creds"}})
    plan = plan_job(job)[0]
    worker = resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test")["spec"]
    env = {e["name"]: e.get("valueFrom") for e in worker["containers"][0]["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-creds",
                                                         "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"]["name"] == "s3-creds"
    assert env["AWS_SESSION_TOKEN"]["secretKeyRef"]["optional"] is True
    claims = [v for v in worker["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"name": "claim-0", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    assert {"name": "claim-0", "mountPath": f"{storing.PVC_ROOT}/ckpt"} in \
        worker["containers"][0]["volumeMounts"]
    # the planner checks it can write them before any worker starts: the same storage
    planner = resources.planner_pod(OWNER, job, "ravnest:test")["spec"]
    assert planner["containers"][0]["env"] == worker["containers"][0]["env"][-3:]
    assert [v for v in planner["volumes"] if "persistentVolumeClaim" in v] == claims


def test_a_template_may_not_mount_where_the_claims_go():
    from ravnest import storing

    with pytest.raises(SpecError, match="is mounted by the operator"):
        _job({"spec": {"containers": [{"volumeMounts": [
            {"name": "x", "mountPath": f"{storing.PVC_ROOT}/ckpt"}]}]}})


def test_the_finishing_pod_reads_the_roots_metadata_with_the_workers_hardening():
    job = _job(TEMPLATE, output={"uri": "pvc://models/digits", "resources": {
        "limits": {"memory": "8Gi"}}}, storage={"s3": {"credentialsSecret": "s3-creds"}})
    plan = plan_job(job)[0]
    pod = resources.finisher_pod(OWNER, job, plan, "ravnest:test")
    worker = resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test")
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "digits-finish"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "finisher"
    assert container["args"] == ["finish", "--metadata", "/etc/ravnest/node.json"]
    root = resources.pod_name("digits", plan.clusters[0].nodes[0])
    assert {"name": "node-metadata", "configMap": {"name": root}} in spec["volumes"]
    assert {"name": "claim-0", "persistentVolumeClaim": {"claimName": "models"}} in spec["volumes"]
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    assert spec["securityContext"] == worker["spec"]["securityContext"]
    assert container["securityContext"] == worker["spec"]["containers"][0]["securityContext"]
    assert [e["name"] for e in container["env"] if e["name"].startswith("AWS_")] == [
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]
    assert container["resources"] == {"limits": {"memory": "8Gi"}}  # the template's are workers'
    assert spec["activeDeadlineSeconds"] == 1800


def _container(**security: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "ravnest", "securityContext": security}]}}


# What Pod Security's restricted level refuses, each with the path the error names and the
# exemption a cluster admin could grant the namespace for it (None: never the template's).
BEYOND_RESTRICTED = [
    (_container(privileged=True), "spec.template.spec.containers[0].securityContext.privileged",
     "privileged"),
    (_container(allowPrivilegeEscalation=True),
     "spec.template.spec.containers[0].securityContext.allowPrivilegeEscalation", "privileged"),
    (_container(procMount="Unmasked"),
     "spec.template.spec.containers[0].securityContext.procMount", "privileged"),
    (_container(seccompProfile={"type": "Unconfined"}),
     "spec.template.spec.containers[0].securityContext.seccompProfile.type", "privileged"),
    (_container(capabilities={"add": ["SYS_ADMIN"], "drop": ["ALL"]}),
     "spec.template.spec.containers[0].securityContext.capabilities.add", "capabilities"),
    (_container(capabilities={"add": ["NET_BIND_SERVICE"]}),
     "spec.template.spec.containers[0].securityContext.capabilities.drop", "capabilities"),
    (_container(runAsUser=0), "spec.template.spec.containers[0].securityContext.runAsUser",
     "root"),
    ({"spec": {"securityContext": {"runAsNonRoot": False}}},
     "spec.template.spec.securityContext.runAsNonRoot", "root"),
    ({"spec": {"securityContext": {"seLinuxOptions": {"user": "system_u"}}}},
     "spec.template.spec.securityContext.seLinuxOptions", "privileged"),
    ({"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}},
     "spec.template.spec.securityContext.sysctls[0]", "privileged"),
    ({"spec": {"securityContext": {"windowsOptions": {"hostProcess": True}}}},
     "spec.template.spec.securityContext.windowsOptions.hostProcess", "privileged"),
    ({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
     "spec.template.spec.volumes[0].hostPath", "hostPath"),
    ({"spec": {"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}},
     "spec.template.spec.volumes[0].nfs", "volumes"),
    ({"spec": {"volumes": [{"name": "t", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token"}}]}}]}},
     "spec.template.spec.volumes[0].projected.sources[0].serviceAccountToken",
     "serviceAccountToken"),
    ({"spec": {"automountServiceAccountToken": True}},
     "spec.template.spec.automountServiceAccountToken", "serviceAccountToken"),
    ({"spec": {"initContainers": [{"name": "i", "image": "busybox"}]}},
     "spec.template.spec.initContainers", "initContainers"),
    ({"spec": {"tolerations": [{"operator": "Exists"}]}}, "spec.template.spec.tolerations[0]",
     "scheduling"),
    ({"spec": {"priorityClassName": "system-node-critical"}},
     "spec.template.spec.priorityClassName", "scheduling"),
    ({"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/ravnest": "unconfined"}}},
     "spec.template.metadata.annotations['container.apparmor.security.beta.kubernetes.io/"
     "ravnest']", "privileged"),
    ({"metadata": {"labels": {"ravnest.io/job": "other"}}},
     "spec.template.metadata.labels['ravnest.io/job']", None),
    ({"metadata": {"annotations": {"ravnest.io/recovery": "1"}}},
     "spec.template.metadata.annotations['ravnest.io/recovery']", None),
]


@pytest.mark.parametrize(("template", "path", "exemption"), BEYOND_RESTRICTED)
def test_a_template_beyond_pod_securitys_restricted_level_is_refused_by_path(
        template, path, exemption):
    with pytest.raises(SpecError) as e:
        _job(template)
    (problem,) = e.value.problems
    assert problem.startswith(f"{path}: "), problem
    if exemption is None:  # the operator's keys: allowed to nobody
        with pytest.raises(SpecError):
            _job(template, allow=set(podsecurity.EXEMPTIONS))
    else:  # the admin's exemption for the namespace lets it through, and no other does
        assert repr(exemption) in problem and "templatePolicy.allow" in problem
        assert _job(template, allow={exemption}).spec.template is not None
        with pytest.raises(SpecError):
            _job(template, allow=set(podsecurity.EXEMPTIONS) - {exemption})


def test_what_the_restricted_level_allows_a_template_keeps():
    """Everything restricted allows, set explicitly, passes: the check is the level, not a ban
    on security fields."""
    job = _job({"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/ravnest": "runtime/default"}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 0,
                                "fsGroup": 3000, "seccompProfile": {"type": "Localhost",
                                                                    "localhostProfile": "p.json"},
                                "seLinuxOptions": {"type": "container_t", "level": "s0:c1"},
                                "sysctls": [{"name": "net.ipv4.tcp_keepalive_time",
                                             "value": "60"}]},
            "containers": [{"name": "ravnest", "securityContext": {
                "allowPrivilegeEscalation": False, "privileged": False,
                "readOnlyRootFilesystem": False, "procMount": "Default",
                "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                "appArmorProfile": {"type": "RuntimeDefault"}}}],
            "volumes": [{"name": "c", "configMap": {"name": "x"}},
                        {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                        {"name": "p", "projected": {"sources": [{"secret": {"name": "s"}}]}},
                        {"name": "d", "csi": {"driver": "x"}}],
            "automountServiceAccountToken": False,
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "priorityClassName": "research"}})
    assert job.spec.template is not None


def test_every_refusal_is_listed_at_once():
    with pytest.raises(SpecError) as e:
        _job({"spec": {"initContainers": [{"name": "i"}], "automountServiceAccountToken": True,
                       "containers": [{"name": "ravnest", "securityContext": {
                           "privileged": True, "runAsUser": 0}}]}})
    assert len(e.value.problems) == 4, e.value.problems


def test_the_operator_reads_the_admins_exemptions_per_namespace():
    allow = json.dumps({"ml-infra": ["hostPath", "root"], "*": ["initContainers"]})
    settings = Settings.from_env({"RAVNEST_TEMPLATE_ALLOW": allow})
    assert settings.allowed("ml-infra") == {"hostPath", "root", "initContainers"}
    assert settings.allowed("team-a") == {"initContainers"}
    assert Settings.from_env({}).allowed("ml-infra") == frozenset()
    for bad, says in [("{", "not JSON"), ('["hostPath"]', "JSON object"),
                      ('{"a": "hostPath"}', "list of names"),
                      ('{"a": ["hostpath"]}', "unknown ['hostpath']")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            Settings.from_env({"RAVNEST_TEMPLATE_ALLOW": bad})


def test_the_checkpoint_volume_is_held_to_the_same_level():
    """spec.checkpoint.volume is mounted in every pod the operator makes: a hostPath there is
    the host's filesystem as surely as one in the template."""
    host = {"hostPath": {"path": "/"}}
    with pytest.raises(SpecError) as e:
        _job(checkpoint={"volume": host})
    (problem,) = e.value.problems
    assert problem.startswith("spec.checkpoint.volume.hostPath: a hostPath volume is not "
                              "allowed"), problem
    assert _job(checkpoint={"volume": host}, allow={"hostPath"}).spec.checkpoint.volume == host
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.volume\.nfs: a nfs volume"):
        _job(checkpoint={"volume": {"nfs": {"server": "n", "path": "/"}}})
    claim = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    assert _job(checkpoint={"volume": claim}).spec.checkpoint.volume == claim


@pytest.mark.parametrize(("volume", "says"), [
    ({"name": "mine", "persistentVolumeClaim": {"claimName": "c"}},
     "must be one volume source (e.g. persistentVolumeClaim: {claimName: ...}), got ['name', "
     "'persistentVolumeClaim']; the operator names the volume"),
    ({"emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}, "must be one volume source"),
    ({}, "must be one volume source (e.g. persistentVolumeClaim: {claimName: ...}), got none"),
    ({"persistentVolume": {"claimName": "c"}}, "'persistentVolume' is not a volume source"),
    ({"configMap": {"name": "x"}}, "a configMap volume is read-only"),
    ({"persistentVolumeClaim": "c"}, "persistentVolumeClaim: must be a mapping, got 'c'"),
])
def test_a_checkpoint_volume_must_be_one_writable_volume_source(volume, says):
    """What the apiserver would refuse with 422 when the first pod is made is refused by the
    validator, by path, before anything is made."""
    with pytest.raises(SpecError) as e:
        _job(checkpoint={"volume": volume})
    (problem,) = e.value.problems
    assert problem.startswith("spec.checkpoint.volume: ") and says in problem, problem


@pytest.mark.parametrize(("field", "value"), [("dnsPolicy", "Bogus"),
                                              ("preemptionPolicy", "Sometimes")])
def test_a_pod_field_the_apiserver_would_refuse_is_refused_by_path(field, value):
    with pytest.raises(SpecError) as e:
        _job({"spec": {field: value}})
    (problem,) = e.value.problems
    assert problem.startswith(f"spec.template.spec.{field}: "), problem


def test_the_pods_grace_period_is_the_templates():
    """The operator deletes pods with their own grace period (it used to force 5 s): a
    template that needs longer to shut down gets it, on worker and planner pods alike."""
    bare, _, _ = pods_of(None)
    assert bare["spec"]["terminationGracePeriodSeconds"] == resources.GRACE_SECONDS
    worker, planner = pods_of({"spec": {"terminationGracePeriodSeconds": 120}})[1:]
    assert worker["spec"]["terminationGracePeriodSeconds"] == 120
    assert planner["spec"]["terminationGracePeriodSeconds"] == 120


def pods_of(template: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    job = _job(template)
    plan = plan_job(job)[0]
    return (resources.pod(OWNER, _job(), plan, plan.nodes[0], "ravnest:test"),
            resources.pod(OWNER, job, plan, plan.nodes[0], "ravnest:test"),
            resources.planner_pod(OWNER, job, "ravnest:test"))
