"""Ray's autoscaler on a pool cluster's head (issue 22), as on this machine (`local_monitor.py`)
but over SSH: the monitor's files reach the head's host over SFTP (a 0700 folder in the
cluster's dir there, the node token 0600, each file replaced whole), and the monitor reaches the
node API through an SSH remote forward: a socket file in that folder (`ssh_forward.py`). The API
never listens on the pool's network, and the node token crosses it encrypted.

The forward lives with the controller's connection to the head's host: a new connection (a
dropped one, a restarted controller) makes it again, at the next look at the cluster
(`keep_reachable`). Meanwhile the module's calls fail and Ray's monitor tries again at its next
update."""

from __future__ import annotations

import json
import logging
from functools import partial
from urllib.parse import urlsplit

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import autoscaling_config, node_api_token
from servekeeper.providers.base import PermanentProviderError, ProviderError, RetryableProviderError
from servekeeper.providers.local_monitor import (
    CONFIG_FILE,
    MODULE_FILE,
    MONITOR_DIR,
    TOKEN_FILE,
    URL_FILE,
    NodeApi,
    monitor_env,
    provider_section,
)
from servekeeper.providers.node_argv import cluster_dir
from servekeeper.providers.ssh import SshError, with_retries
from servekeeper.providers.ssh_forward import SocketForwards
from servekeeper.providers.ssh_nodes import SshNodes

logger = logging.getLogger(__name__)

SOCKET_FILE = "node-api.sock"  # the forward's end on the head's host, beside the token
UNIX_PREFIX = "unix:"  # how the module knows a socket file from an http:// address


def monitor_dir(host: HostSpec, cluster: str) -> str:
    """The monitor's folder on the head's host: in the cluster's dir, which goes with the cluster."""
    return f"{cluster_dir(host, cluster)}/{MONITOR_DIR}"


class PoolMonitors:
    """The monitors of a pool's autoscaled clusters: their files, and the way to the node API."""

    def __init__(self, node_api: NodeApi | None) -> None:
        self.node_api = node_api  # None: no cluster may be autoscaled (the monitor has no one to ask)
        self.forwards = SocketForwards()
        # cluster -> (the head's host, its forward's socket) as pointed at by this controller
        # (none yet after a restart: everything is written again at the first look)
        self._written: dict[str, tuple[str, str]] = {}

    def _api(self, cluster: ClusterRecord) -> NodeApi:
        if self.node_api is None:
            raise PermanentProviderError(f"{cluster.name}: Ray's autoscaler needs the node API, which is not served")
        return self.node_api

    async def install(
        self, ssh: SshNodes, cluster: ClusterRecord, config: RayClusterConfigSpec
    ) -> tuple[list[str], dict[str, str]]:
        """Put the module, the config, the API's address and the token on the head's host; the
        head's extra `ray start` flags and environment."""
        head = cluster.nodes[0]
        directory = monitor_dir(ssh.host(head.host), cluster.name)
        await ssh.make_dirs(head.host, [directory])
        connection = ssh.connection(head.host)
        await with_retries(partial(connection.put_file, MODULE_FILE, f"{directory}/{MODULE_FILE.name}", 0o600))
        await self._point(ssh, cluster, config, configs=True)
        # The host's own PYTHONPATH is not known here: the head's spec gives it, if any.
        env = monitor_env(directory, config.head.env.get("PYTHONPATH", ""))
        return [f"--autoscaling-config={directory}/{CONFIG_FILE}"], env

    async def keep_reachable(self, ssh: SshNodes, cluster: ClusterRecord) -> None:
        """At every look: the head's url file names the forward this controller holds now (the
        first look after a restart rewrites the token and the config from the record too, as
        `point_monitors_at` does on this machine). A host that does not answer is left to the
        liveness look, which tells it."""
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if not config.enableInTreeAutoscaling or not cluster.nodes or cluster.nodes[0].pid is None:
            return
        try:
            await self._point(ssh, cluster, config, configs=cluster.name not in self._written)
        except (SshError, ProviderError) as exc:
            self._written.pop(cluster.name, None)
            logger.info("[%s] the head's monitor is not pointed at the node API yet: %s", cluster.name, exc)

    async def update_config(self, ssh: SshNodes, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        """The monitor's config replaced with `config`'s bounds and options (it reads it at each
        update). A head not started yet gets them at its start (its folder may not exist)."""
        head = cluster.nodes[0] if cluster.nodes else None
        if head is None or head.pid is None:
            return
        directory = monitor_dir(ssh.host(head.host), cluster.name)
        try:
            await self._write(ssh, head.host, f"{directory}/{CONFIG_FILE}", self._config(cluster, config, directory))
        except SshError as exc:
            raise RetryableProviderError(f"the monitor's config on host {head.host}: {exc}") from exc

    def forget(self, cluster: str) -> None:
        """The cluster is gone: its forward too (its socket file went with the cluster's dir)."""
        written = self._written.pop(cluster, None)
        if written is not None:
            self.forwards.drop(*written)

    async def _point(self, ssh: SshNodes, cluster: ClusterRecord, config: RayClusterConfigSpec, configs: bool) -> None:
        api = self._api(cluster)
        head = cluster.nodes[0]
        target = urlsplit(api.url)
        assert target.hostname is not None and target.port is not None
        directory = monitor_dir(ssh.host(head.host), cluster.name)
        socket_path = f"{directory}/{SOCKET_FILE}"
        previous = self._written.get(cluster.name)
        if previous is not None and previous[0] != head.host:  # the head moved: not forwarded there any more
            self.forget(cluster.name)
        # Not retried: at a look, a silent host is the look's to tell (the start is retried whole).
        made = await self.forwards.ensure(ssh.connection(head.host), socket_path, target.hostname, target.port)
        if not configs and not made and self._written.get(cluster.name) == (head.host, socket_path):
            return
        await self._write(ssh, head.host, f"{directory}/{TOKEN_FILE}", node_api_token(api.secret, cluster.name))
        if configs:
            await self._write(ssh, head.host, f"{directory}/{CONFIG_FILE}", self._config(cluster, config, directory))
        await self._write(ssh, head.host, f"{directory}/{URL_FILE}", f"{UNIX_PREFIX}{socket_path}")
        self._written[cluster.name] = (head.host, socket_path)

    @staticmethod
    def _config(cluster: ClusterRecord, config: RayClusterConfigSpec, directory: str) -> str:
        return json.dumps(autoscaling_config(cluster.name, config, provider_section(cluster.name, directory)), indent=2)

    @staticmethod
    async def _write(ssh: SshNodes, host: str, path: str, text: str) -> None:
        connection = ssh.connection(host)
        await with_retries(partial(connection.write_file, path, text.encode(), 0o600))
