"""What a node's log says of its exit: its last few lines, bounded, for an event's message (the
cause an operator needs when a node exits: `WorkerRestarting`, `RolloutFailed HeadDied`).

A node's log is the app's and Ray's free text: before any of it goes into an event, the
cluster's env values are blanked out, in the escaped forms a program prints them in too (JSON, a
Python repr, URL-quoted). A value that came from a secret (listed by the service's import fact)
is blanked whatever its length; the others from MIN_HIDDEN_CHARS on. A provider that cannot
read the facts blanks every value from MIN_HIDDEN_CHARS_UNKNOWN on."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Collection

from servekeeper.kuberay.notes import SecretRef
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.store.facts import import_fact_key
from servekeeper.store.store import Store

LAST_LINES = 5
LAST_CHARS = 600
TAIL_BYTES = 4096  # read from the end of a log: enough for LAST_LINES lines of LAST_CHARS
# Literal env values shorter than this are left in the text ("1", "true", a port): blanking
# them would garble the message, and a credential typed into a spec is longer.
MIN_HIDDEN_CHARS = 6
# When which values came from secrets is not known: a short secret (a PIN) is still blanked.
MIN_HIDDEN_CHARS_UNKNOWN = 4
HIDDEN = "***"


def env_values(cluster_spec_json: str) -> dict[tuple[str, str], str]:
    """Every value of the env of the cluster's head ("head") and worker groups, by (group, name)."""
    config = RayClusterConfigSpec.model_validate_json(cluster_spec_json)
    groups = [("head", config.head.env), *((group.name, group.env) for group in config.workerGroups)]
    return {(group, name): value for group, env in groups for name, value in env.items()}


def secret_envs(store: Store, cluster: ClusterRecord) -> set[tuple[str, str]]:
    """The (group, env name) pairs whose values came from secrets: of the cluster's revision, and
    of the service's latest import (should that revision's fact be pruned already)."""
    keys = (import_fact_key(cluster.service, cluster.generation), import_fact_key(cluster.service))
    refs = [ref for key in keys for ref in (store.get_fact(key) or {}).get("secretRefs", [])]
    return {(secret.group, secret.env) for secret in map(SecretRef.from_json, refs)}


def hidden_values(cluster: ClusterRecord, store: Store | None) -> frozenset[str]:
    """What a node's log must not show of the cluster's env, each in every printed form. With
    `store`, its import facts tell the secrets apart; without, every value from
    MIN_HIDDEN_CHARS_UNKNOWN on is hidden."""
    values = env_values(cluster.cluster_spec_json)
    if store is None:
        hidden = {value for value in values.values() if len(value) >= MIN_HIDDEN_CHARS_UNKNOWN}
    else:
        secrets = secret_envs(store, cluster)
        hidden = {value for key, value in values.items() if key in secrets or len(value) >= MIN_HIDDEN_CHARS}
    return frozenset(form for value in hidden if value for form in printed_forms(value))


def printed_forms(value: str) -> set[str]:
    """`value` as it is and as JSON, a Python repr and a URL print it (without their quotes)."""
    forms = {
        value,
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        repr(value)[1:-1],
        urllib.parse.quote(value),
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value),
    }
    return {form for form in forms if form}


def last_lines(text: str, lines: int = LAST_LINES, chars: int = LAST_CHARS, hide: Collection[str] = ()) -> str:
    """The last `lines` non-empty lines of `text`, joined by " | ", cut to their last `chars`
    characters; "empty log" when there are none. Each of `hide` is blanked out first, the
    longest first, in one pass (a blank is never blanked again)."""
    hidden = sorted({value for value in hide if value}, key=len, reverse=True)
    if hidden:
        text = re.sub("|".join(map(re.escape, hidden)), HIDDEN, text)
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(meaningful[-lines:])
    if len(joined) > chars:
        joined = "..." + joined[-(chars - 3) :]
    return joined or "empty log"
