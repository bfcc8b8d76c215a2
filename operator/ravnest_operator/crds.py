"""The RavnestJob CustomResourceDefinition, generated from the job spec model.

`ravnest.spec.JobSpec` is the one source of truth: its JSON schema is turned into a structural
OpenAPI v3 schema (refs inlined, nullable instead of null unions, free-form maps marked
`x-kubernetes-preserve-unknown-fields`), so `kubectl apply` rejects what the schema can express and
the operator's validator (the same model) reports the rest. `.status` is generated the same way from
`ravnest.run.jobstatus.JobStatus`, which also checks every status patch the operator decides.
``python -m ravnest_operator.crds`` prints the CRD; `crds/ravnestjob.yaml` is that output, and a
test keeps the two equal.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from ravnest.run.jobstatus import JobStatus
from ravnest.spec import JobSpec

GROUP = "ravnest.io"
VERSION = "v1alpha1"
PLURAL = "ravnestjobs"
KIND = "RavnestJob"

_KEEP = ("type", "items", "enum", "minimum", "maximum", "minItems", "maxItems", "minLength",
         "maxLength", "pattern", "format")


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[1]]
        resolved = _structural(target, defs)
        if "description" in schema:
            resolved["description"] = schema["description"]
        return resolved
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        types = sorted(s.get("type", "") for s in options)
        if types == ["integer", "string"]:
            union: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        elif len(options) == 1:
            union = _structural(options[0], defs)
        else:
            raise ValueError(f"cannot express {schema} in a structural schema")
        if len(options) < len(schema["anyOf"]):
            union["nullable"] = True
        for key in ("description", "default"):
            if schema.get(key) is not None:
                union[key] = schema[key]
        return union
    out: dict[str, Any] = {}
    for key in _KEEP:
        if key in schema:
            out[key] = schema[key]
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "exclusiveMinimum" in schema:
        out["minimum"] = schema["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in schema:
        out["maximum"] = schema["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if "items" in schema:
        out["items"] = _structural(schema["items"], defs)
    if "properties" in schema:
        out["type"] = "object"
        out["properties"] = {k: _structural(v, defs) for k, v in schema["properties"].items()}
        if schema.get("required"):
            out["required"] = list(schema["required"])
    elif schema.get("type") == "object":
        extra = schema.get("additionalProperties", True)
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    for key in ("description", "default"):
        if schema.get(key) is not None:
            out[key] = schema[key]
    return out


SPEC_RULES = [
    {"rule": "has(self.managedBy) == has(oldSelf.managedBy) && "
             "(!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
     "message": "spec.managedBy is immutable", "fieldPath": ".managedBy",
     "reason": "FieldValueInvalid"},
]
"""CEL rules the apiserver holds `.spec` to (with no webhook to ask): a transition rule is
checked on updates only."""


def spec_schema() -> dict[str, Any]:
    """The structural schema of `.spec`, from the job spec model, with its CEL rules."""
    raw = JobSpec.model_json_schema(by_alias=True, mode="validation")
    return {**_structural(raw, raw.get("$defs", {})), "x-kubernetes-validations": SPEC_RULES}


def status_schema() -> dict[str, Any]:
    """The structural schema of `.status`, from the job status model: the apiserver keeps these
    fields and no others (only `result`, the workers' own figures, is a free-form map)."""
    raw = JobStatus.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Plan", "type": "string", "jsonPath": ".status.plan.summary",
     "description": "clusters x stages"},
    {"name": "Clusters", "type": "string", "jsonPath": ".status.clusters",
     "description": "clusters active / planned"},
    {"name": "Epoch", "type": "integer", "jsonPath": ".status.progress.epoch"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.display"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Accuracy", "type": "number", "jsonPath": ".status.progress.validationMetric"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition document."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "ravnestjob",
                      "shortNames": ["rj"], "categories": ["all", "ravnest"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A decentralized training job: a model split into stages over "
                                   "provider pods grouped in clusters.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def render() -> str:
    header = ("# Generated by `python -m ravnest_operator.crds` from ravnest.spec.JobSpec and "
              "ravnest.run.jobstatus.JobStatus. Do not edit.\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
