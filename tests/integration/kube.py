"""A real etcd + kube-apiserver on 127.0.0.1 for the operator's integration tests.

The binaries are the ones `scripts/k8s-tools` builds from their Go modules and caches in
`${RAVNEST_TOOLS:-~/.cache/ravnest-tools}/bin` (looked up there first, then on PATH).

    with local_apiserver() as kube:
        kube.kubectl("get", "ns")            # or KUBECONFIG=kube.kubeconfig for any client

The API server authenticates one admin user by a static bearer token (group system:masters, so
RBAC lets it do anything), serves HTTPS with a self-signed certificate on 127.0.0.1 only, and signs
service-account tokens with a key pair made here with openssl. Nothing runs a kubelet; the
ServiceAccount admission plugin is off so Pods are accepted without the token controller.
`controller_manager=True` also runs kube-controller-manager (garbage collection, namespace deletion,
service accounts, disruption budgets' status).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("RAVNEST_TOOLS") or Path.home() / ".cache" / "ravnest-tools")
BIN = TOOLS / "bin"
SERVICE_CIDR = "10.0.0.0/24"


class MissingBinary(RuntimeError):
    """An upstream binary the harness needs is neither built nor on PATH."""


def find_binary(name: str) -> str:
    """The cached build of `name`, else the one on PATH; MissingBinary says how to get it."""
    cached = BIN / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if found:
        return found
    raise MissingBinary(
        f"{name} not found in {BIN} nor on PATH: run {ROOT / 'scripts' / 'k8s-tools'} "
        f"to build it from its Go module (once; cached outside the repo, set RAVNEST_TOOLS "
        f"to use another cache folder)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalApiserver:
    server: str  # https://127.0.0.1:PORT
    token: str  # bearer token of the admin user (group system:masters)
    kubeconfig: Path
    workdir: Path
    etcd_url: str
    kubectl_path: str = ""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60,
                input: str | None = None) -> str:
        """Run kubectl against this server; returns stdout, raises with stderr on failure."""
        kubectl = self.kubectl_path or find_binary("kubectl")
        proc = subprocess.run([kubectl, "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stderr.strip()}")
        return proc.stdout

    def log(self, name: str) -> str:
        """The combined output of one of the processes (etcd, kube-apiserver, ...)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise MissingBinary("openssl is needed to make the service-account key pair")
    subprocess.run([openssl, *args], check=True, capture_output=True)


def _tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class _Procs:
    """Started processes, stopped in reverse order: terminate, wait, then kill."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.workdir)
        self.running[name] = proc
        return proc

    def check(self) -> None:
        for name, proc in self.running.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} while starting; last lines of "
                                   f"its log:\n{_tail(self.workdir / f'{name}.log')}")

    def stop(self, grace: float = 10) -> None:
        for _name, proc in reversed(list(self.running.items())):
            stop_process(proc, grace)
        self.running.clear()


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10, kill: bool = False) -> None:
    """Terminate (or kill) a process the tests started and reap it; SIGKILL after `grace` s."""
    if proc.poll() is not None:
        return
    (proc.kill if kill else proc.terminate)()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(url: str, token: str, procs: _Procs, timeout: float) -> None:
    """Poll url (an HTTPS health endpoint) until it answers 200."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        procs.check()
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read().decode(errors='replace')[-2000:]}"
            e.close()
        except (OSError, ssl.SSLError) as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s; last answer: {last}")
        time.sleep(0.3)


def _wait_etcd(url: str, procs: _Procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        procs.check()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if b'"health":"true"' in resp.read():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"etcd at {url} not healthy after {timeout:.0f}s:\n"
                               f"{_tail(procs.workdir / 'etcd.log')}")
        time.sleep(0.2)


def apiserver_args(*, etcd_url: str, port: int, certs: Path, tokens: Path, sa_key: Path,
                   sa_pub: Path) -> list[str]:
    """The kube-apiserver flags the harness uses (without the binary)."""
    return [
        f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={certs}",
        f"--token-auth-file={tokens}",
        "--authorization-mode=RBAC",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={sa_pub}",
        f"--service-account-signing-key-file={sa_key}",
        "--disable-admission-plugins=ServiceAccount",
        "--allow-privileged=true",
        "--endpoint-reconciler-type=none",
        "--profiling=false",
    ]


@contextlib.contextmanager
def local_apiserver(workdir: Path | None = None, *, controller_manager: bool = False,
                    extra_args: Sequence[str] = (), timeout: float = 120
                    ) -> Iterator[LocalApiserver]:
    """Start etcd and kube-apiserver on 127.0.0.1 (free ports), wait for /readyz, yield, stop.

    workdir (e.g. pytest's tmp_path) keeps the data, certificates and logs; without it a temporary
    folder is used and removed afterwards. extra_args go to kube-apiserver.
    """
    etcd = find_binary("etcd")
    apiserver = find_binary("kube-apiserver")
    kcm = find_binary("kube-controller-manager") if controller_manager else ""
    kubectl = ""
    with contextlib.suppress(MissingBinary):
        kubectl = find_binary("kubectl")
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ravnest-kube-")) if workdir is None else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    procs = _Procs(work)
    try:
        token = secrets.token_hex(16)
        tokens = work / "tokens.csv"
        tokens.write_text(f'{token},admin,admin,"system:masters"\n')
        tokens.chmod(0o600)
        sa_key, sa_pub = work / "sa.key", work / "sa.pub"
        _openssl("genrsa", "-out", str(sa_key), "2048")
        _openssl("rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))

        client, peer, port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client}"
        procs.start("etcd", [
            etcd, "--name=default", f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn"])
        _wait_etcd(etcd_url, procs, timeout)

        server = f"https://127.0.0.1:{port}"
        procs.start("kube-apiserver", [apiserver, *apiserver_args(
            etcd_url=etcd_url, port=port, certs=work / "certs", tokens=tokens, sa_key=sa_key,
            sa_pub=sa_pub), *extra_args])
        _wait_ready(f"{server}/readyz", token, procs, timeout)

        kubeconfig = work / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {
                # the serving cert kube-apiserver made for itself; its file also holds its CA
                "server": server,
                "certificate-authority": str(work / "certs" / "apiserver.crt")}}],
            "users": [{"name": "admin", "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {
                "cluster": "local", "user": "admin", "namespace": "default"}}],
        }))
        kubeconfig.chmod(0o600)

        if controller_manager:
            procs.start("kube-controller-manager", [
                kcm, f"--kubeconfig={kubeconfig}", "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--controllers=garbage-collector-controller,namespace-controller,"
                "serviceaccount-controller,serviceaccount-token-controller,disruption-controller",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={work / 'certs' / 'apiserver.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=false"])
            _wait_ready(f"https://127.0.0.1:{_kcm_port(procs)}/healthz", token, procs, timeout)

        yield LocalApiserver(server=server, token=token, kubeconfig=kubeconfig, workdir=work,
                             etcd_url=etcd_url, kubectl_path=kubectl,
                             processes=dict(procs.running))
    finally:
        procs.stop()
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _kcm_port(procs: _Procs) -> int:
    argv = procs.running["kube-controller-manager"].args
    assert isinstance(argv, list)
    return int(next(a for a in argv if a.startswith("--secure-port=")).split("=", 1)[1])
