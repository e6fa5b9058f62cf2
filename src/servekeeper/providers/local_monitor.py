"""Ray's autoscaler on a local cluster's head (issue 22): the head runs Ray's monitor with
`--autoscaling-config`, and the monitor loads servekeeper's node provider module from a folder
of the cluster's own (its log dir, in the state dir: 0700), beside its config and the cluster's
node token (0600, read at each call, never in argv or the config)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import autoscaling_config, node_api_token

MODULE_FILE = Path(__file__).resolve().parent / "node_provider" / "servekeeper_node_provider.py"
PROVIDER_CLASS = f"{MODULE_FILE.stem}.NodeProvider"
# How often the monitor looks (Ray's default is 5 s): Ray on Spark uses 1 s too.
UPDATE_INTERVAL_SECONDS = 1


@dataclass(frozen=True)
class NodeApi:
    """Where a head's monitor reaches the daemon's node API, and the daemon's token its
    per-cluster node token is derived from."""

    url: str
    secret: str


def monitor_files(
    cluster: ClusterRecord, config: RayClusterConfigSpec, api: NodeApi
) -> tuple[list[str], dict[str, str]]:
    """Write the module, the config and the token for the head of `cluster`; the head's extra
    `ray start` flags and environment. Blocks briefly (three small files)."""
    directory = Path(cluster.log_dir) / "autoscaler"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(MODULE_FILE, directory / MODULE_FILE.name)
    token = directory / "node-token"
    descriptor = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(node_api_token(api.secret, cluster.name))
    provider = {"module": PROVIDER_CLASS, "servekeeper_url": api.url, "cluster": cluster.name, "token_file": str(token)}
    config_file = directory / "autoscaling.json"
    config_file.write_text(json.dumps(autoscaling_config(cluster.name, config, provider), indent=2))
    # ahead of the head's own PYTHONPATH (the spec's, else the daemon's), never instead of it
    own = config.head.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    search_path = os.pathsep.join(p for p in (str(directory), own) if p)
    env = {"PYTHONPATH": search_path, "AUTOSCALER_UPDATE_INTERVAL_S": str(UPDATE_INTERVAL_SECONDS)}
    return [f"--autoscaling-config={config_file}"], env
