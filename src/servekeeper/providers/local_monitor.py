"""Ray's autoscaler on a local cluster's head (issue 22): the head runs Ray's monitor with
`--autoscaling-config`, and the monitor loads servekeeper's node provider module from a folder
of the cluster's own (its log dir, in the state dir: 0700), beside its config and the cluster's
node token (0600, read at each call, never in argv or the config)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import autoscaling_config, node_api_token

MODULE_FILE = Path(__file__).resolve().parent / "node_provider" / "servekeeper_node_provider.py"
PROVIDER_CLASS = f"{MODULE_FILE.stem}.NodeProvider"
MONITOR_DIR = "autoscaler"  # in the cluster's log dir
URL_FILE = "node-api-url"
TOKEN_FILE = "node-token"
CONFIG_FILE = "autoscaling.json"
# How often the monitor looks (Ray's default is 5 s): Ray on Spark uses 1 s too.
UPDATE_INTERVAL_SECONDS = 1
# A node is "running" to the monitor once its process is, and Ray releases a running node whose
# raylet has not reported within this time ("lost contact with raylet"). Ray's 30 s is also how
# long a raylet may take to register on a loaded host: twice that, so that a slow start is not
# taken for a lost node (a dead one is the controller's to find and start again).
HEARTBEAT_TIMEOUT_SECONDS = 60
# Ray's monitor exits for good after its 6th failed update (AUTOSCALER_MAX_NUM_FAILURES, 5, is
# counted over its whole life, never reset by a success), and nothing starts it again: a node
# API out of reach for six looks (a controller restarted, an SSH forward made again) would end
# the cluster's autoscaling. Each failed look is retried at the next one instead.
MAX_FAILED_UPDATES = 10**9


@dataclass(frozen=True)
class NodeApi:
    """Where a head's monitor reaches the daemon's node API, and the daemon's token its
    per-cluster node token is derived from."""

    url: str
    secret: str


def monitor_files(
    cluster: ClusterRecord, config: RayClusterConfigSpec, api: NodeApi
) -> tuple[list[str], dict[str, str]]:
    """Write the module, the config, the API's address and the token for the head of
    `cluster`; the head's extra `ray start` flags and environment. Blocks briefly."""
    directory = Path(cluster.log_dir) / MONITOR_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(MODULE_FILE, directory / MODULE_FILE.name)
    point_monitors_at(api, [cluster])
    config_file = write_autoscaling_config(cluster, config)
    own = config.head.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return [f"--autoscaling-config={config_file}"], monitor_env(str(directory), own)


def monitor_env(directory: str, own_search_path: str) -> dict[str, str]:
    """The head's environment for its monitor: the module's folder ahead of the head's own
    PYTHONPATH, never instead of it."""
    search_path = os.pathsep.join(p for p in (directory, own_search_path) if p)
    return {
        "PYTHONPATH": search_path,
        "AUTOSCALER_UPDATE_INTERVAL_S": str(UPDATE_INTERVAL_SECONDS),
        "AUTOSCALER_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_SECONDS),
        "AUTOSCALER_MAX_NUM_FAILURES": str(MAX_FAILED_UPDATES),
    }


def provider_section(cluster: str, directory: str) -> dict[str, str]:
    """What the module needs to find the node API: where its address and its token are on the head."""
    return {
        "module": PROVIDER_CLASS,
        "cluster": cluster,
        "url_file": f"{directory}/{URL_FILE}",
        "token_file": f"{directory}/{TOKEN_FILE}",
    }


def write_autoscaling_config(cluster: ClusterRecord, config: RayClusterConfigSpec) -> Path:
    """The monitor's config of `cluster` from `config` (its bounds, its options), replaced whole:
    written at the head's start and again when only the bounds change, which the monitor, reading
    it at each look, follows without a restart."""
    directory = Path(cluster.log_dir) / MONITOR_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    provider = provider_section(cluster.name, str(directory))
    config_file = directory / CONFIG_FILE
    _write_private(config_file, json.dumps(autoscaling_config(cluster.name, config, provider), indent=2))
    return config_file


def point_monitors_at(api: NodeApi, clusters: Iterable[ClusterRecord], configs: bool = False) -> None:
    """Where each autoscaled cluster's monitor finds the node API, and its token: written at a
    head's start and again at every `up` (the API's port may change; heads outlive the daemon),
    read by the module at each call. With `configs` (at `up`), each monitor's config too, from
    the cluster's record: a controller killed between a bounds change's two writes leaves the
    file ahead of the record. Clusters with no monitor folder are left alone."""
    for cluster in clusters:
        directory = Path(cluster.log_dir) / MONITOR_DIR
        if cluster.pool is not None or not directory.is_dir():
            continue
        _write_private(directory / TOKEN_FILE, node_api_token(api.secret, cluster.name))
        _write_private(directory / URL_FILE, api.url)
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if configs and config.enableInTreeAutoscaling:
            write_autoscaling_config(cluster, config)


def _write_private(path: Path, text: str) -> None:
    """0600 from its creation, replaced whole (a reader never sees half of it)."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.replace(partial, path)
