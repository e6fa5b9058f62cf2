"""When a Ray release was published, read from the package index: an environment resolves Ray's
own dependencies as they were that day, as the release's image holds them. Resolved today, an
old Ray gets today's libraries, which it may not run on (measured: Ray 2.52.0's Serve fails on
protobuf 7, `FieldDescriptor` has no `label`; its image has protobuf 5)."""

from __future__ import annotations

import logging
import os

import httpx

logger = logging.getLogger(__name__)

DEFAULT_INDEX = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691; upload times are PEP 700
INDEX_TIMEOUT_SECONDS = 30.0


def index_url() -> str:
    """The index uv resolves from (its own settings, then pip's), PyPI's by default."""
    for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return DEFAULT_INDEX


def release_time_of(files: list[dict[str, object]], version: str) -> str | None:
    """The last upload time of the release's files (all its wheels are out then), from a PEP 691
    project page; None when the index gives no upload times or has no file of the release."""
    prefixes = (f"ray-{version}-", f"ray-{version}.tar.gz")
    times = [
        str(entry["upload-time"])
        for entry in files
        if str(entry.get("filename", "")).startswith(prefixes) and entry.get("upload-time")
    ]
    return max(times) if times else None


async def ray_release_time(version: str) -> str | None:
    """When Ray `version` was published (RFC 3339, as uv's --exclude-newer takes it), or None
    when the index cannot say: the environment is then resolved against today's packages."""
    url = f"{index_url()}/ray/"
    try:
        async with httpx.AsyncClient(timeout=INDEX_TIMEOUT_SECONDS, follow_redirects=True) as client:
            answer = await client.get(url, headers={"Accept": SIMPLE_JSON})
            answer.raise_for_status()
            files = answer.json().get("files", [])
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("the release time of Ray %s is unknown (%s: %s): resolved as of today", version, url, error)
        return None
    released = release_time_of(files, version)
    if released is None:
        logger.warning("%s gives no upload time of Ray %s: resolved as of today", url, version)
    return released
