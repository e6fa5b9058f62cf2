"""Ray's autoscaler on a pool cluster's head (issue 22), as on this machine (`local_monitor.py`)
but over SSH: the monitor's files reach the head's host over SFTP (a 0700 folder in the
cluster's dir there, the node token 0600, each file replaced whole), and the monitor reaches the
node API through an SSH remote forward on that host's loopback. The API never listens on the
pool's network, and the node token crosses it encrypted.

The forward lives with the controller's connection to the head's host: a new connection (a
dropped one, a restarted controller) has a new port there, which `keep_reachable`, called at
every look at the cluster, writes to the head's url file. The module reads that file at each
call, so the monitor follows without a restart; while no forward exists, its calls fail and
Ray's monitor tries again at its next update."""

from __future__ import annotations

import json
import logging
from functools import partial
from urllib.parse import urlsplit

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import autoscaling_config, node_api_token
from servekeeper.providers.base import PermanentProviderError, ProviderError
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
from servekeeper.providers.ssh_nodes import SshNodes

logger = logging.getLogger(__name__)


def monitor_dir(host: HostSpec, cluster: str) -> str:
    """The monitor's folder on the head's host: in the cluster's dir, which goes with the cluster."""
    return f"{cluster_dir(host, cluster)}/{MONITOR_DIR}"


class PoolMonitors:
    """The monitors of a pool's autoscaled clusters: their files, and the way to the node API."""

    def __init__(self, node_api: NodeApi | None) -> None:
        self.node_api = node_api  # None: no cluster may be autoscaled (the monitor has no one to ask)
        # cluster -> (the head's host, the forward's port there) its url file names, as written
        # by this controller (none yet after a restart: written again at the first look)
        self._written: dict[str, tuple[str, int]] = {}

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
        """The monitor's config replaced with `config`'s bounds and options (it reads it at each update)."""
        head = cluster.nodes[0]
        directory = monitor_dir(ssh.host(head.host), cluster.name)
        await self._write(ssh, head.host, f"{directory}/{CONFIG_FILE}", self._config(cluster, config, directory))

    def forget(self, cluster: str) -> None:
        self._written.pop(cluster, None)

    async def _point(self, ssh: SshNodes, cluster: ClusterRecord, config: RayClusterConfigSpec, configs: bool) -> None:
        api = self._api(cluster)
        head = cluster.nodes[0]
        target = urlsplit(api.url)
        assert target.hostname is not None and target.port is not None
        connection = ssh.connection(head.host)
        # Not retried: at a look, a silent host is the look's to tell (the start is retried whole).
        port = await connection.forward_here(target.hostname, target.port)
        if not configs and self._written.get(cluster.name) == (head.host, port):
            return
        directory = monitor_dir(ssh.host(head.host), cluster.name)
        await self._write(ssh, head.host, f"{directory}/{TOKEN_FILE}", node_api_token(api.secret, cluster.name))
        if configs:
            await self._write(ssh, head.host, f"{directory}/{CONFIG_FILE}", self._config(cluster, config, directory))
        await self._write(ssh, head.host, f"{directory}/{URL_FILE}", f"http://127.0.0.1:{port}")
        self._written[cluster.name] = (head.host, port)

    @staticmethod
    def _config(cluster: ClusterRecord, config: RayClusterConfigSpec, directory: str) -> str:
        return json.dumps(autoscaling_config(cluster.name, config, provider_section(cluster.name, directory)), indent=2)

    @staticmethod
    async def _write(ssh: SshNodes, host: str, path: str, text: str) -> None:
        connection = ssh.connection(host)
        await with_retries(partial(connection.write_file, path, text.encode(), 0o600))
