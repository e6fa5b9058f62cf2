"""When a Ray release was published, read from the package index: an environment resolves Ray's
own dependencies as they were that day, as the release's image holds them. Resolved today, an
old Ray gets today's libraries, which it may not run on (measured: Ray 2.52.0's Serve fails on
protobuf 7, `FieldDescriptor` has no `label`; its image has protobuf 5)."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta

import httpx

from servekeeper.providers.base import RetryableProviderError

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


def configured_index() -> list[str]:
    """pip's `--index-url` for the index uv was told to use (none told: pip's own settings)."""
    told = [os.environ[name] for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL") if os.environ.get(name)]
    return ["--index-url", told[0]] if told else []


def release_time_of(files: list[dict[str, object]], version: str) -> str | None:
    """The last upload time of the release's files (all its wheels are out then), from a PEP 691
    project page; None when the index gives no upload times or has no file of the release."""
    prefixes = (f"ray-{version}-", f"ray-{version}.tar.gz")
    times = [
        str(entry["upload-time"])
        for entry in files
        if str(entry.get("filename", "")).startswith(prefixes) and entry.get("upload-time")
    ]
    if not times:
        return None
    # uv keeps only files uploaded before the cutoff: a minute past the last, so it is in
    # to the second (PEP 700's times are UTC; Python 3.10 parses no fraction or "Z")
    last = datetime.strptime(max(times)[:19], "%Y-%m-%dT%H:%M:%S") + timedelta(minutes=1)
    return last.strftime("%Y-%m-%dT%H:%M:%SZ")


async def ray_release_time(version: str) -> str | None:
    """A minute after Ray `version` was published (RFC 3339, as uv's --exclude-newer takes it),
    or None when the index gives no upload times (a page that is not PEP 691 JSON, or without
    PEP 700's times): the environment is then resolved against today's packages. An index that
    does not answer raises RetryableProviderError: a lock written then would be kept for good."""
    url = f"{index_url()}/ray/"
    shown = httpx.URL(url).copy_with(username=None, password=None)  # an index URL may carry a token
    try:
        async with httpx.AsyncClient(timeout=INDEX_TIMEOUT_SECONDS, follow_redirects=True) as client:
            answer = await client.get(url, headers={"Accept": SIMPLE_JSON})
            answer.raise_for_status()
    except httpx.HTTPError as error:
        raise RetryableProviderError(
            f"the index {shown} did not answer for Ray {version}: {type(error).__name__}"
        ) from None
    try:
        files = answer.json().get("files", [])
    except ValueError:
        files = []
    released = release_time_of(files, version)
    if released is None:
        logger.warning("%s gives no upload time of Ray %s: resolved as of today", shown, version)
    return released
