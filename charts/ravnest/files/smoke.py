"""`helm test`: create a small RavnestJob, wait until it Succeeded, delete it.

Runs in the test hook Pod (the ravnest image: python, pyyaml and the kubernetes client), with a
ServiceAccount that may only create, get and delete RavnestJobs. Outside a cluster it uses the
kubeconfig. Exit status 0: the job succeeded; 1: it failed or timed out (the job is kept so that its
status and events can be read; the next run replaces it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

GROUP = "ravnest.io"
VERSION = "v1alpha1"
PLURAL = "ravnestjobs"

log = logging.getLogger("ravnest-test")


def _exists(api: client.CustomObjectsApi, namespace: str, name: str) -> bool:
    try:
        api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    with open(os.environ.get("RAVNEST_TEST_JOB", "/etc/ravnest-test/job.yaml")) as fh:
        job = yaml.safe_load(fh)
    timeout = float(os.environ.get("RAVNEST_TEST_TIMEOUT", "900"))
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    api = client.CustomObjectsApi()
    deadline = time.monotonic() + timeout

    try:  # a job left over by a failed run
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise
    while _exists(api, namespace, name):
        if time.monotonic() > deadline:
            log.info(f"the previous {namespace}/{name} is still being deleted")
            return 1
        time.sleep(1)

    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    log.info(f"created RavnestJob {namespace}/{name}; waiting up to {timeout:.0f}s")
    last = None
    while time.monotonic() < deadline:
        status = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                  name).get("status") or {}
        phase = status.get("phase")
        shown = (phase, (status.get("progress") or {}).get("display"))
        if shown != last:
            log.info(f"phase {phase} step {shown[1]}")
            last = shown
        if phase == "Succeeded":
            log.info(f"succeeded: {json.dumps(status.get('result') or {})}")
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return 0
        if phase == "Failed":
            log.info(f"failed: {json.dumps(status.get('conditions') or [], indent=1)}")
            return 1
        time.sleep(2)
    log.info(f"timed out after {timeout:.0f}s in phase {last and last[0]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
