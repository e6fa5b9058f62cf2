"""A fleet of "hosts" on this machine: Linux network namespaces joined by a bridge, each with its
own address and Debian's OpenSSH server, for tests of multi-host Ray clusters over SSH.

    root namespace  10.231.7.1/24 on bridge skfbr<pid>
      skf<pid>-1    10.231.7.11  sshd on port 22, host key of its own
      skf<pid>-2    10.231.7.12
      skf<pid>-3    10.231.7.13

The range is private and used only here: the namespaces have no default route, so nothing
leaves the machine. The hosts share the machine's filesystem and process table (only the
network is theirs), so a host's `python` can be this checkout's venv. Every run names its
namespaces, bridge and veths after its pid, removes those of dead runs before it starts, and
tears its own down (sshd, anything still running in a namespace, namespaces, bridge) even when
setup or a test fails. Needs root (CI runs as root) and /usr/sbin/sshd (`scripts/setup.sh
--tests` installs openssh-server).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SUBNET_PREFIX = "10.231.7"
ROOT_ADDRESS = f"{SUBNET_PREFIX}.1"
SSHD = "/usr/sbin/sshd"
SSH_USER = "root"
NAMESPACE_PATTERN = re.compile(r"^skf(\d+)-\d+$")


def fleet_unavailable_reason() -> str | None:
    """Why no fleet can be built here, or None."""
    if os.geteuid() != 0:
        return "the fleet needs root (network namespaces, bridge, veth)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing: apt-get install openssh-server (scripts/setup.sh --tests does)"
    if shutil.which("ip") is None or shutil.which("ssh-keygen") is None:
        return "the fleet needs `ip` (iproute2) and `ssh-keygen` (openssh-client)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(namespace: str) -> list[int]:
    """Processes whose network namespace is `namespace` (`ip netns pids`)."""
    result = _run("ip", "netns", "pids", namespace, check=False)
    return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []


def _kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL whatever still runs in the namespace; returns what was found."""
    found = namespace_pids(namespace)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def remove_stale_fleets() -> None:
    """Namespaces and bridges of fleets whose test run died without tearing them down."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        match = NAMESPACE_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(f"/tmp/{name}", ignore_errors=True)
    links = _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    for bridge in re.findall(r"^\d+: (skfbr(\d+))[:@]", links, flags=re.MULTILINE):
        if not _pid_alive(int(bridge[1])):
            _run("ip", "link", "del", bridge[0], check=False)


@dataclass
class FleetHost:
    name: str  # host-1, host-2, ...
    namespace: str
    address: str
    directory: Path
    veth: str  # the root namespace's end of the host's cable to the bridge
    sshd: subprocess.Popen[bytes] | None = None

    @property
    def work_dir(self) -> str:
        """The host's workDir in the pool: short (Ray's unix sockets are nested under it)."""
        return f"/tmp/{self.namespace}"

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command inside the host's network namespace (as if run on that host)."""
        return _run("ip", "netns", "exec", self.namespace, *argv, check=check)

    def pids(self) -> list[int]:
        """Every process in the host's network namespace (sshd included)."""
        return namespace_pids(self.namespace)

    def set_sftp(self, enabled: bool) -> None:
        """Turn the host's SFTP subsystem off or on (sshd reloads its config on SIGHUP), and
        drop every open SSH connection to it so the next one sees the change."""
        assert self.sshd is not None
        config = self.directory / "sshd_config"
        lines = [line for line in config.read_text().splitlines() if not line.startswith("Subsystem")]
        if enabled:
            lines.append("Subsystem sftp internal-sftp")
        config.write_text("\n".join(lines) + "\n")
        self.sshd.send_signal(signal.SIGHUP)
        for pid in self.pids():
            if pid != self.sshd.pid and _is_sshd(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # a connection's own sshd: the connection drops
        time.sleep(0.5)  # the listener re-executes itself on SIGHUP
        _wait_for_sshd(self, timeout=15)


@dataclass
class Fleet:
    directory: Path
    hosts: list[FleetHost] = field(default_factory=list)
    client_key: Path = Path()
    known_hosts: Path = Path()
    bridge: str = ""
    setup_seconds: float = 0.0

    def host_pool_document(
        self,
        name: str = "fleet",
        python: str | None = None,
        cpus: float | dict[str, float] = 2,
        hosts: list[str] | None = None,
    ) -> dict[str, Any]:
        """A HostPool spec for the fleet (or the `hosts` named); every host's python defaults
        to this test run's; `cpus` for every host, or per host name."""
        import sys

        def cpus_of(host: FleetHost) -> float:
            return cpus[host.name] if isinstance(cpus, dict) else cpus

        return {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "HostPool",
            "metadata": {"name": name},
            "spec": {
                "hosts": [
                    {
                        "name": host.name,
                        "address": host.address,
                        "ssh": {
                            "user": SSH_USER,
                            "port": 22,
                            "identityFile": str(self.client_key),
                            "knownHostsFile": str(self.known_hosts),
                            "connectTimeoutSeconds": 5,
                        },
                        "python": python or sys.executable,
                        "resources": {"cpus": cpus_of(host), "gpus": 0, "memoryGiB": 4},
                        "workDir": host.work_dir,
                    }
                    for host in self.hosts
                    if hosts is None or host.name in hosts
                ]
            },
        }

    def leftovers_described(self) -> dict[str, list[str]]:
        """What is left on the hosts, each with its state and command line: a teardown failure
        then says what survived. Checked at once: a process no stop signalled may exit on its
        own a moment later, and is an orphan all the same."""
        return {host: [_described(pid) for pid in pids] for host, pids in self.leftover_processes().items()}

    def leftover_processes(self) -> dict[str, list[int]]:
        """Processes in each host's namespace other than sshd (its listener and the processes
        that serve open SSH connections)."""
        leftovers = {}
        for host in self.hosts:
            others = [pid for pid in host.pids() if not _is_sshd(pid)]
            if others:
                leftovers[host.name] = others
        return leftovers


def _described(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        return f"{pid} {process.status()} {' '.join(process.cmdline())[:300]}"
    except psutil.Error:
        return f"{pid} (gone)"


def _is_sshd(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe") == SSHD
    except OSError:
        return False  # gone, or a kernel thread: not ours either way


def _keygen(path: Path, comment: str) -> str:
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return Path(f"{path}.pub").read_text().strip()


def _sshd_config(host: FleetHost, authorized_keys: Path) -> str:
    return "\n".join(
        [
            f"ListenAddress {host.address}",
            "Port 22",
            f"HostKey {host.directory / 'ssh_host_ed25519_key'}",
            f"PidFile {host.directory / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",  # the keys live in a pytest temp dir
            "Subsystem sftp internal-sftp",
            "LogLevel VERBOSE",
            "",
        ]
    )


def _wait_for_sshd(host: FleetHost, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host.sshd is not None and host.sshd.poll() is not None:
            log = (host.directory / "sshd.log").read_text(errors="replace")
            raise RuntimeError(f"sshd of {host.name} exited ({host.sshd.returncode}): {log[-800:]}")
        try:
            with socket.create_connection((host.address, 22), timeout=0.5) as sock:
                if sock.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd of {host.name} did not answer on {host.address}:22 within {timeout}s")


def _build(fleet: Fleet, size: int) -> None:
    started = time.monotonic()
    pid = os.getpid()
    fleet.bridge = f"skfbr{pid}"
    _run("ip", "link", "add", fleet.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{ROOT_ADDRESS}/24", "dev", fleet.bridge)
    _run("ip", "link", "set", fleet.bridge, "up")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    client_key = fleet.directory / "id_ed25519"
    authorized_keys = fleet.directory / "authorized_keys"
    authorized_keys.write_text(_keygen(client_key, "servekeeper-fleet-test") + "\n")
    fleet.client_key = client_key
    known_lines = []
    for index in range(1, size + 1):
        host = FleetHost(
            name=f"host-{index}",
            namespace=f"skf{pid}-{index}",
            address=f"{SUBNET_PREFIX}.{10 + index}",
            directory=fleet.directory / f"host-{index}",
            veth=f"skfv{pid}-{index}",
        )
        fleet.hosts.append(host)
        host.directory.mkdir()
        veth = host.veth
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _run("ip", "link", "set", veth, "master", fleet.bridge)
        _run("ip", "link", "set", veth, "up")
        host.run("ip", "link", "set", "lo", "up")
        host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        public_key = _keygen(host.directory / "ssh_host_ed25519_key", host.name)
        known_lines.append(f"{host.address} {' '.join(public_key.split()[:2])}")
        config = host.directory / "sshd_config"
        config.write_text(_sshd_config(host, authorized_keys))
        with open(host.directory / "sshd.log", "wb") as log:
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, SSHD, "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    fleet.known_hosts = fleet.directory / "known_hosts"
    fleet.known_hosts.write_text("\n".join(known_lines) + "\n")
    for host in fleet.hosts:
        _wait_for_sshd(host, timeout=15)
    fleet.setup_seconds = time.monotonic() - started


def teardown(fleet: Fleet) -> dict[str, list[int]]:
    """Stop every sshd, kill anything left in the namespaces, remove namespaces and bridge.
    Returns what had to be killed besides sshd (a test that leaks processes can assert on it)."""
    leftovers = fleet.leftover_processes()
    for host in fleet.hosts:
        if host.sshd is not None and host.sshd.poll() is None:
            host.sshd.terminate()
            try:
                host.sshd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                host.sshd.kill()
                host.sshd.wait(timeout=5)
        _kill_namespace_processes(host.namespace)
        _run("ip", "link", "del", host.veth, check=False)  # both ends, without waiting for the namespace to go
        _run("ip", "netns", "del", host.namespace, check=False)
        shutil.rmtree(host.work_dir, ignore_errors=True)
    if fleet.bridge:
        _run("ip", "link", "del", fleet.bridge, check=False)
    shutil.rmtree(fleet.directory, ignore_errors=True)
    return leftovers


@contextlib.contextmanager
def fleet_of(directory: Path, size: int = 3) -> Iterator[Fleet]:
    """A fleet of `size` hosts, torn down on exit whatever happened."""
    remove_stale_fleets()
    fleet = Fleet(directory=directory)
    try:
        _build(fleet, size)
        yield fleet
    finally:
        teardown(fleet)
