"""A two-node Ray cluster on 127.0.0.1 for tests: `ray start --head` and `ray start --address`,
each on its own free ports, with the dashboard (job submission) on the head.

Each node is a `ray start --block` child process: on SIGTERM it stops the Ray processes it
started (and only those), so stopping the cluster never touches another Ray on the machine.
The head keeps its files in its own --temp-dir, so a plain `ray.init()` elsewhere on the
machine does not find this cluster either.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent          # the venv's bin: ray, python


_GIVEN: set[int] = set()        # ports handed out here: Ray binds them later, so the OS still says free


def _bindable(port: int) -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port free now and not handed out before (a worker range included)."""
    while True:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def worker_ports(width: int = 40) -> range:
    """`width` + 1 consecutive ports, free now and disjoint from every port handed out. (Picked
    apart, a node's object-manager port once fell inside its own worker range and Ray refused
    to start: "worker_ports is trying to use a port number ... used by other components".)"""
    while True:
        base = min(free_port(), 65000 - width)
        ports = range(base, base + width + 1)
        if all(p == base or (p not in _GIVEN and _bindable(p)) for p in ports):
            _GIVEN.update(ports)
            return ports


def node_ports() -> list[str]:
    """The per-node ports; worker processes get a 40-port range of their own, chosen first."""
    workers = worker_ports()
    return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()),
            "--min-worker-port", str(workers[0]), "--max-worker-port", str(workers[-1])]


_TOKEN = secrets.token_hex(32)


def node_env() -> dict:
    """The nodes (and so the job's entrypoint and actors) use this venv's python; nodes and
    clients share a token of this session's own (Ray's token auth; nothing written to ~/.ray)."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=_TOKEN)
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class LocalCluster:
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], name: str) -> None:
        log = open(os.path.join(self.temp_dir, f"{name}.log"), "w")
        self.logs.append(log)
        cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
               "--num-gpus", "0", "--object-store-memory", str(100 * 2**20), *args, *node_ports()]
        self.procs.append(subprocess.Popen(cmd, env=node_env(), stdout=log, stderr=subprocess.STDOUT))

    def start_head(self, num_cpus: int = 1) -> None:
        self._start(["--head", "--port", str(self.gcs_port), "--num-cpus", str(num_cpus),
                     "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                     "--dashboard-port", str(self.dashboard_port),
                     "--ray-client-server-port", str(free_port()),
                     "--temp-dir", self.temp_dir, "--disable-usage-stats"], "head")

    def add_node(self, num_cpus: int = 1) -> None:
        self._start(["--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", str(num_cpus)],
                    f"node{len(self.procs)}")

    def alive_nodes(self) -> int:
        """Nodes the dashboard's state API lists as alive (0 while it is not up)."""
        try:
            request = urllib.request.Request(f"{self.dashboard}/api/v0/nodes?limit=100",
                                             headers={"Authorization": f"Bearer {_TOKEN}"})
            with urllib.request.urlopen(request, timeout=5) as r:
                nodes = json.load(r)["data"]["result"]["result"]
        except (OSError, ValueError, KeyError):
            return 0
        return sum(1 for n in nodes if n.get("state") == "ALIVE")

    def wait_for_nodes(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.args[2:4] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"ray start exited early:\n{self.log_tails()}")
            if self.alive_nodes() >= n:
                return
            time.sleep(1)
        raise TimeoutError(f"{n} Ray nodes not alive after {timeout}s:\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for log in self.logs:
            log.flush()
            with open(log.name) as f:
                tails.append(f"== {log.name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(tails)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM each node (workers first), wait, then SIGKILL what is left."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for log in self.logs:
            log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
