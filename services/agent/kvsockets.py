"""Where an engine's KV event sockets live: Unix sockets only the agent's user can reach.

On loopback TCP any local process (another tenant's job on a shared GPU node) could
publish forged KV events into a relay, which steers every router's prefix routing, or
ask an engine's replay socket for its block history. ZMQ's ipc:// transport is a Unix
socket, and connecting to one needs search permission on every directory above it, so
the sockets sit in one directory of the state dir with mode 0700, owned by the agent's
user (the engines it starts run as that user too): no other user gets in, whatever the
socket files' own modes.

vLLM, SGLang and the simulator bind an ipc:// endpoint, for their publisher as for their
replay socket (the relay connects to both); binding first removes a socket file a dead
engine left at that path. So each shard has fixed names here, made short, since a Unix
socket path holds at most 107 bytes: a state dir too deep for them is refused at start,
not found out when an engine fails to bind.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Collection
from pathlib import Path

DIR_NAME = "kv"
# sun_path is 108 bytes on Linux, its terminating NUL included.
MAX_SOCKET_PATH = 107
_EVENTS, _REPLAY = ".ev", ".rp"
_HASH_CHARS = 12  # 48 bits of the shard id: collisions between a node's shards are moot
PREFIX = "ipc://"


class SocketDirError(OSError):
    """The socket directory cannot be made private, or is too deep for a socket path."""


def _name(shard_id: str) -> str:
    return hashlib.blake2b(shard_id.encode(), digest_size=_HASH_CHARS // 2).hexdigest()


def endpoints(directory: Path, shard_id: str) -> tuple[str, str]:
    """The shard's (events, replay) endpoints: where its engine binds its publisher and
    its replay socket."""
    base = directory / _name(shard_id)
    return f"{PREFIX}{base}{_EVENTS}", f"{PREFIX}{base}{_REPLAY}"


def prepare(directory: Path) -> Path:
    """Create `directory` with mode 0700 (or make an existing one so) and check that it is
    this user's own directory, not a link, and shallow enough for its socket paths."""
    longest = len(os.fsencode(directory / ("x" * _HASH_CHARS + _EVENTS)))
    if longest > MAX_SOCKET_PATH:
        raise SocketDirError(
            f"state dir too deep for the KV event sockets: {directory}/ leaves "
            f"{longest} bytes per socket path, Unix sockets allow {MAX_SOCKET_PATH}; "
            "choose a shorter state_dir"
        )
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise SocketDirError(
            f"{directory} is not a directory of this user (uid {os.geteuid()}): the KV "
            "event sockets must be in one no other user can enter"
        )
    os.chmod(directory, 0o700)  # the mode mkdir gave (umask) or an earlier one
    return directory


def prune(directory: Path, keep: Collection[str]) -> None:
    """Remove the socket files of engines that are gone: every file here whose endpoint
    is not in `keep` (the live shards' endpoints). Only while no engine is being
    launched, since a launching engine's endpoint is in no live record yet."""
    for path in directory.iterdir():
        if f"{PREFIX}{path}" not in keep:
            path.unlink(missing_ok=True)
