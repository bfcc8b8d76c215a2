"""Which apiserver answers refuse an object for good, and what the job is told of one. The Status
bodies are as the apiserver writes them (tests/integration/test_operator_passes.py has the real
apiserver refuse a pod and checks the job's condition from its answer)."""

from __future__ import annotations

import json

import pytest

from ravnest_operator.refusals import MESSAGE_CHARS, Refusal, refusal

INVALID = json.dumps({
    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
    "message": 'Pod "digits-node-1" is invalid: spec.containers[0].resources.requests: Invalid '
               'value: "2": must be less than or equal to cpu limit of 1',
    "reason": "Invalid",
    "details": {"name": "digits-node-1", "kind": "Pod", "causes": [
        {"reason": "FieldValueInvalid", "message": 'Invalid value: "2": must be less than or '
         'equal to cpu limit of 1', "field": "spec.containers[0].resources.requests"},
        {"reason": "FieldValueInvalid", "message": "again",
         "field": "spec.containers[0].resources.requests"},
        {"reason": "FieldValueRequired", "message": "Required value",
         "field": "spec.volumes[2].name"}]},
    "code": 422})


def test_an_invalid_object_is_refused_naming_its_fields_each_once():
    r = refusal("Pod", "digits-node-1", 422, "Unprocessable Entity", INVALID)
    assert r == Refusal("Pod", "digits-node-1", 422, "Invalid", json.loads(INVALID)["message"],
                        ("spec.containers[0].resources.requests", "spec.volumes[2].name"))
    said = r.said()
    assert said.startswith("the apiserver refused Pod digits-node-1: 422 Invalid: Pod ")
    assert "(fields: spec.containers[0].resources.requests, spec.volumes[2].name)" in said
    assert "spec.template" in said
    assert said.endswith("what this pass made is deleted (its Secrets go with the job)")


def test_pod_security_is_a_refusal_other_forbidden_answers_are_retried():
    security = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden",
                           "code": 403, "message": 'pods "x" is forbidden: violates PodSecurity '
                           '"restricted:latest": seccompProfile (pod or container "worker" must '
                           'set securityContext.seccompProfile.type)'})
    r = refusal("Pod", "x", 403, "Forbidden", security)
    assert r is not None and r.code == 403 and "violates PodSecurity" in r.message
    assert r.fields == ()
    quota = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden",
                        "code": 403, "message": 'pods "x" is forbidden: exceeded quota: q, '
                        'requested: pods=1, used: pods=4, limited: pods=4'})
    rbac = json.dumps({"kind": "Status", "reason": "Forbidden", "code": 403,
                       "message": 'pods is forbidden: User "op" cannot create resource "pods"'})
    assert refusal("Pod", "x", 403, "Forbidden", quota) is None
    assert refusal("Pod", "x", 403, "Forbidden", rbac) is None


@pytest.mark.parametrize("code", [400, 413])
def test_a_malformed_or_too_large_object_is_refused(code):
    r = refusal("ConfigMap", "digits-plan", code, "Bad Request", b"not a Status")
    assert r == Refusal("ConfigMap", "digits-plan", code, "Bad Request", "not a Status")
    assert "its fields come from the plan" in r.said()


@pytest.mark.parametrize("code", [None, 401, 404, 409, 429, 500, 503, 504])
def test_answers_that_can_pass_are_retried(code):
    assert refusal("Pod", "x", code, "whatever", INVALID) is None


def test_a_hostile_answer_is_bounded_and_its_odd_shapes_ignored():
    huge = json.dumps({"reason": ["not", "a", "string"], "message": "m" * 100_000,
                       "details": {"causes": [{"field": "f" * 10_000}, "junk", {"field": 3},
                                              *({"field": f"f{i}"} for i in range(50))]}})
    r = refusal("Secret", "s", 422, None, huge)
    assert r is not None and len(r.message) == MESSAGE_CHARS and r.message.endswith("...")
    assert r.reason == "" and len(r.fields) == 8 and len(r.fields[0]) == 200
    assert refusal("Secret", "s", 422, "Invalid", json.dumps([1, 2])) == Refusal(
        "Secret", "s", 422, "Invalid", "[1, 2]")
    assert refusal("Secret", "s", 422, "Invalid", None) == Refusal(
        "Secret", "s", 422, "Invalid", "(no message)")
