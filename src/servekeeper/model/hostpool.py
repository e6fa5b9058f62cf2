"""A host pool: the machines that multi-host Ray clusters run on, reached over SSH.

    apiVersion: servekeeper/v1alpha1
    kind: HostPool
    metadata: {name: fleet}
    spec:
      hosts:
        - name: gpu-a
          address: 10.0.0.11
          ssh: {user: ray, port: 22, identityFile: ~/.ssh/id_ed25519, knownHostsFile: ~/.ssh/known_hosts}
          python: /opt/ray-env/bin/python       # its `ray` must be the controller's Ray version
          resources: {cpus: 16, gpus: 2, memoryGiB: 64}

Strict like the service spec (`extra="forbid"`), every problem reported at once by field path.
Paths on the controller (the key and known_hosts files) may start with `~`; paths on a host
(`python`, `workDir`) must be absolute, since no shell ever expands them there.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from servekeeper.model.base import DNS_LABEL, StrictModel
from servekeeper.model.spec import Metadata, SpecError, format_errors, single_document

HOST_POOL_KIND = "HostPool"
# RFC 1123 host names: dot-separated labels of letters, digits and '-'.
_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
POSIX_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
# A unix socket path is limited to 107 bytes and Ray nests its sockets a few levels under the
# node's temp dir, which lives under workDir: keep the root short.
MAX_WORK_DIR_LENGTH = 40
WORK_DIR_PREFIX = "/tmp/servekeeper-"


def default_work_dir(user: str) -> str:
    """A work dir per SSH user (the node agent refuses one another user owns): a shared one in
    /tmp could be pre-created by anyone on the host. A long user name goes by its hash."""
    work_dir = f"{WORK_DIR_PREFIX}{user}"
    if len(work_dir) <= MAX_WORK_DIR_LENGTH:
        return work_dir
    return f"/tmp/sk-{hashlib.sha256(user.encode()).hexdigest()[:16]}"


def _controller_path(value: str) -> str:
    if not value or any(ch in value for ch in "\x00\n\r"):
        raise ValueError("must be a non-empty path without NUL or line breaks")
    if not (value.startswith(("/", "~/")) or value == "~"):
        raise ValueError(f"{value!r} must be an absolute path or start with '~/'")
    return value


def _host_path(value: str) -> str:
    if not value.startswith("/") or any(ch in value for ch in "\x00\n\r"):
        raise ValueError(f"{value!r} must be an absolute path on the host (no '~': no shell expands it there)")
    return value


class SshSpec(StrictModel):
    user: str
    port: int = Field(default=22, ge=1, le=65535)
    identityFile: str
    knownHostsFile: str
    connectTimeoutSeconds: float = Field(default=10, gt=0, le=300)

    _paths = field_validator("identityFile", "knownHostsFile")(_controller_path)

    @field_validator("user")
    @classmethod
    def _user_shape(cls, user: str) -> str:
        if not POSIX_USER.match(user):
            raise ValueError(f"{user!r} is not a user name (lowercase letters, digits, '_', '.', '-')")
        return user

    def identity_path(self) -> Path:
        return Path(self.identityFile).expanduser()

    def known_hosts_path(self) -> Path:
        return Path(self.knownHostsFile).expanduser()


class HostResources(StrictModel):
    cpus: float = Field(gt=0, le=4096)
    gpus: float = Field(default=0, ge=0, le=1024)
    memoryGiB: float = Field(gt=0, le=65536)


class HostSpec(StrictModel):
    name: str
    address: str
    ssh: SshSpec
    python: str
    resources: HostResources
    # Where the host's Ray nodes keep their temp dirs and logs (short: unix socket paths);
    # when not given, default_work_dir(ssh.user), filled in before validation.
    workDir: str = ""

    _python = field_validator("python")(_host_path)

    @model_validator(mode="before")
    @classmethod
    def _work_dir_per_user(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("workDir"):
            return data
        ssh = data.get("ssh")
        user = ssh.get("user") if isinstance(ssh, dict) else getattr(ssh, "user", None)
        if isinstance(user, str) and POSIX_USER.match(user):
            return {**data, "workDir": default_work_dir(user)}
        return data  # the bad user name is reported; the empty workDir is not (see below)

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, name: str) -> str:
        if not DNS_LABEL.match(name):
            raise ValueError(f"{name!r} is not a DNS label (lowercase letters, digits, '-')")
        return name

    @field_validator("address")
    @classmethod
    def _address_shape(cls, address: str) -> str:
        try:
            return str(ipaddress.ip_address(address))
        except ValueError:
            pass
        if not HOSTNAME.match(address) or address.replace(".", "").isdigit():
            raise ValueError(f"{address!r} is neither an IP address nor a host name")
        return address.lower()

    @field_validator("workDir")
    @classmethod
    def _work_dir_shape(cls, work_dir: str) -> str:
        if not work_dir:
            return work_dir  # only when ssh.user is invalid, which is the error then
        _host_path(work_dir)
        if len(work_dir) > MAX_WORK_DIR_LENGTH:
            raise ValueError(f"at most {MAX_WORK_DIR_LENGTH} characters (Ray's unix socket paths live under it)")
        return work_dir.rstrip("/") or "/"


class HostPoolBody(StrictModel):
    hosts: list[HostSpec] = Field(min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _unique_hosts(self) -> HostPoolBody:
        problems = []
        for label, values in (
            ("names", [host.name for host in self.hosts]),
            ("addresses", [host.address for host in self.hosts]),
        ):
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                problems.append(f"host {label} must be unique; repeated: {repeated}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class HostPoolSpec(StrictModel):
    apiVersion: Literal["servekeeper/v1alpha1"]
    kind: Literal["HostPool"]
    metadata: Metadata
    spec: HostPoolBody

    @property
    def name(self) -> str:
        return self.metadata.name

    def host_names(self) -> list[str]:
        return [host.name for host in self.spec.hosts]

    def host(self, name: str) -> HostSpec | None:
        return next((host for host in self.spec.hosts if host.name == name), None)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


@dataclass(frozen=True)
class HostPoolRecord:
    """A pool as stored: its spec as applied, and when."""

    name: str
    spec_json: str
    created_at: float
    updated_at: float

    def spec(self) -> HostPoolSpec:
        return HostPoolSpec.model_validate_json(self.spec_json)


def is_host_pool(document: Any) -> bool:
    return isinstance(document, dict) and document.get("kind") == HOST_POOL_KIND


def parse_host_pool(document: Any) -> HostPoolSpec:
    """Validate a decoded document; raise SpecError listing every problem."""
    if not isinstance(document, dict):
        raise SpecError([f"(document): expected a mapping, got {type(document).__name__}"])
    try:
        return HostPoolSpec.model_validate(document)
    except ValidationError as exc:
        raise SpecError(format_errors(exc)) from exc


def keep_stored_work_dirs(pool: HostPoolSpec, document: dict[str, Any], stored: HostPoolSpec | None) -> HostPoolSpec:
    """`pool` (parsed from `document`) with the stored workDir of each host the document gives
    none: only a workDir written in the document changes it. Pools stored before the per-user
    default saved `/tmp/servekeeper` explicitly; re-applying the same pool.yaml must not move
    hosts in use. A host whose ssh.user changed gets the new user's default (the old user's
    directory would be refused on the host as not ours)."""
    if stored is None:
        return pool
    written = [bool(host.get("workDir")) for host in document["spec"]["hosts"]]
    hosts = []
    for host, work_dir_written in zip(pool.spec.hosts, written, strict=True):
        before = stored.host(host.name)
        if before is not None and not work_dir_written and before.ssh.user == host.ssh.user:
            host = host.model_copy(update={"workDir": before.workDir})
        hosts.append(host)
    return pool.model_copy(update={"spec": pool.spec.model_copy(update={"hosts": hosts})})


def read_single_document(path: Path) -> Any:
    """The one YAML document of a file, or SpecError (unreadable, too large, not YAML, several)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError([f"(file): cannot read {path}: {exc.strerror}"]) from exc
    return single_document(text)


def load_host_pool_file(path: Path) -> HostPoolSpec:
    return parse_host_pool(read_single_document(path))
