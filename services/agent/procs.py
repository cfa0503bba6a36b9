"""Process identity and signalling for engines (Linux /proc).

A pid alone does not identify an engine across an agent restart: pids are reused.
(pid, start time in clock ticks since boot, kernel boot id) does.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def kernel_boot_id() -> str:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot); None if it is gone or a zombie."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def is_alive(pid: int, start: int | None, boot_id: str) -> bool:
    """Whether `pid` is still the very process recorded with this start time and boot id."""
    if start is None or (boot_id and boot_id != kernel_boot_id()):
        return False
    return process_start(pid) == start


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group (an engine and its workers); False if none is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):  # gone, or the id now belongs to another user
        return False


def group_alive(pgid: int) -> bool:
    return signal_group(pgid, 0)
