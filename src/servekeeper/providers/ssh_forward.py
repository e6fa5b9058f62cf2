"""Unix-socket remote forwards over a host's SSH connection (OpenSSH's stream-local forwarding):
a socket file on the host that reaches a TCP address of this machine, encrypted on the way.

Why a socket file and not a port on the host's loopback: in a 0700 folder it is reachable by the
folder's owner only, where a port is open to every user of the host, and a port left behind by a
dropped connection can be bound by anyone, who would then receive each caller's token."""

from __future__ import annotations

import asyncio
import contextlib

import asyncssh

from servekeeper.providers.ssh import CommandFailed, HostConnection, HostUnreachable, SessionRefused

FORWARD_TIMEOUT_SECONDS = 10.0  # a half-open connection never answers a forward's request


class SocketForwards:
    """The forwards this controller holds, by host and socket path; each one is made again when
    the connection it rode is gone (dropped, or its host's entry in the pool changed)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[asyncssh.SSHClientConnection, asyncssh.SSHListener]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def ensure(self, connection: HostConnection, path: str, dest_host: str, dest_port: int) -> bool:
        """A forward from the socket `path` on the connection's host to `dest_host:dest_port`
        here; True when it was made by this call (the socket file is new)."""
        key = (connection.host.name, path)
        async with self._locks.setdefault(key, asyncio.Lock()):
            ssh = await connection.connected()
            held = self._held.get(key)
            if held is not None and held[0] is ssh and not ssh.is_closed():
                return False
            self.drop(*key)
            try:
                listener = await asyncio.wait_for(_forward(ssh, path, dest_host, dest_port), FORWARD_TIMEOUT_SECONDS)
            except asyncssh.ChannelListenError as exc:
                raise SessionRefused(
                    connection.where,
                    f"refused to forward {path} ({exc}); its sshd must allow AllowStreamLocalForwarding",
                ) from exc
            except asyncssh.SFTPError as exc:
                raise CommandFailed(connection.where, ["sftp-remove", path], None, str(exc.reason)) from exc
            except (OSError, asyncio.TimeoutError, asyncssh.Error) as exc:
                await connection.close()
                raise HostUnreachable(connection.where, f"no forward of {path}: {exc!r}") from exc
            self._held[key] = (ssh, listener)
            return True

    def drop(self, host: str, path: str) -> None:
        """Stop forwarding `path` on `host` (its cluster is gone); the socket file goes with its folder."""
        held = self._held.pop((host, path), None)
        if held is not None:
            held[1].close()


async def _forward(
    ssh: asyncssh.SSHClientConnection, path: str, dest_host: str, dest_port: int
) -> asyncssh.SSHListener:
    # sshd does not bind over a file (unless StreamLocalBindUnlink), and the socket of an earlier
    # connection is still there: removed first.
    async with ssh.start_sftp_client() as sftp:
        with contextlib.suppress(asyncssh.SFTPNoSuchFile):
            await sftp.remove(path)
    return await ssh.forward_remote_path_to_port(path, dest_host, dest_port)
