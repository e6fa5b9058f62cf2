"""Client of the Ray dashboard's Serve REST API and of a cluster's Serve proxy.

Every call to Ray's HTTP endpoints goes through here. Errors are translated at this edge:
retryable (the dashboard is not up yet, a 5xx) versus permanent (Ray rejected the config;
its message is kept verbatim for the service's status).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from servekeeper.core.health import parse_applications
from servekeeper.model.observation import AppState
from servekeeper.rayapi.package import Package

APPLICATIONS_PATH = "/api/serve/applications/"
STATUS_TIMEOUT = aiohttp.ClientTimeout(total=3, sock_connect=1)
PUT_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=2)
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2, sock_connect=1)
# Ray's job SDK uses the same endpoint for `gcs://_ray_pkg_<hash>.zip` working dirs (job_head.py).
PACKAGES_PATH = "/api/packages/gcs/"
UPLOAD_TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=2)


class ServeAPIError(RuntimeError):
    pass


class RetryableServeError(ServeAPIError):
    """Try again later: the dashboard is not reachable or answered 5xx."""


class PermanentServeError(ServeAPIError):
    """Ray rejected the request; retrying the same request will not help."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"Ray rejected the Serve config (HTTP {status}): {body}")


class PermanentPackageError(PermanentServeError):
    """The dashboard refused a package upload (e.g. 413: larger than its 100 MiB request limit)."""

    def __init__(self, status: int, body: str, package_name: str) -> None:
        super().__init__(status, body)
        self.args = (f"Ray refused package {package_name} (HTTP {status}): {body}",)


class ServeClient:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def _request(
        self,
        method: str,
        url: str,
        timeout: aiohttp.ClientTimeout,
        payload: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        try:
            async with self._session.request(method, url, json=payload, timeout=timeout, headers=headers) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise RetryableServeError(f"{method} {url} failed: {exc!r}") from exc

    async def applications(self, dashboard_url: str, headers: Mapping[str, str] | None = None) -> dict[str, AppState]:
        apps, _ = await self.applications_with_capacity(dashboard_url, headers)
        return apps

    async def applications_with_capacity(
        self, dashboard_url: str, headers: Mapping[str, str] | None = None
    ) -> tuple[dict[str, AppState], float | None]:
        """The apps, and Serve's target_capacity (None: unset, every replica). `headers`: a
        cluster with token authentication needs its token on every call."""
        status, body = await self._request("GET", dashboard_url + APPLICATIONS_PATH, STATUS_TIMEOUT, headers=headers)
        if status >= 500:
            raise RetryableServeError(f"GET applications answered {status}: {body[:500]}")
        if status != 200:
            raise PermanentServeError(status, body[:2000])
        try:
            answer = json.loads(body)
            capacity = answer.get("target_capacity")
            return parse_applications(answer), float(capacity) if capacity is not None else None
        except (ValueError, AttributeError, TypeError) as exc:
            raise RetryableServeError(f"GET applications returned unreadable JSON: {exc}") from exc

    async def put_config(
        self, dashboard_url: str, config: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        status, body = await self._request("PUT", dashboard_url + APPLICATIONS_PATH, PUT_TIMEOUT, config, headers)
        if status >= 500:
            raise RetryableServeError(f"PUT applications answered {status}: {body[:500]}")
        if status >= 300:
            raise PermanentServeError(status, body[:2000])

    async def proxy_healthy(self, serve_url: str) -> bool:
        try:
            status, _ = await self._request("GET", serve_url + "/-/healthz", PROBE_TIMEOUT)
        except RetryableServeError:
            return False
        return status == 200

    async def proxy_routes(self, serve_url: str) -> frozenset[str]:
        try:
            status, body = await self._request("GET", serve_url + "/-/routes", PROBE_TIMEOUT)
            if status != 200:
                return frozenset()
            return frozenset(json.loads(body).keys())
        except (RetryableServeError, ValueError, AttributeError):
            return frozenset()

    async def ensure_package(
        self, dashboard_url: str, package: Package, headers: Mapping[str, str] | None = None
    ) -> bool:
        """Upload the package to the cluster's GCS unless it is there already; True if uploaded.

        The GET comes first even when uploading: Ray's handler pins the URI for a while
        (`pin_runtime_env_uri`, RAY_RUNTIME_ENV_URI_PIN_EXPIRATION_S, default 600 s), so the
        package is not garbage-collected before the Serve config that references it arrives.
        """
        url = dashboard_url + PACKAGES_PATH + package.package_name
        status, body = await self._request("GET", url, STATUS_TIMEOUT, headers=headers)
        if status == 200:
            return False
        if status != 404:
            self._raise_package_error("GET", package, status, body)
        data = await asyncio.to_thread(package.path.read_bytes)
        try:
            async with self._session.put(url, data=data, timeout=UPLOAD_TIMEOUT, headers=headers) as response:
                status, body = response.status, await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise RetryableServeError(f"PUT {url} failed: {exc!r}") from exc
        if status != 200:
            self._raise_package_error("PUT", package, status, body)
        return True

    @staticmethod
    def _raise_package_error(method: str, package: Package, status: int, body: str) -> None:
        if status >= 500:
            raise RetryableServeError(f"{method} package {package.package_name} answered {status}: {body[:500]}")
        raise PermanentPackageError(status, body[:2000], package.package_name)
