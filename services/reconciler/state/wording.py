"""The few formatters every explanation shares: times, sizes, counts. Pure.

Placement, the autoscaler and replay put decisions into words an
operator reads, and replay compares those words with the ones recorded. So a
time, a size or a count is written one way everywhere, and never by anything
that depends on the machine (its time zone, its locale).
"""

from __future__ import annotations

import time


def clock_text(ts: float) -> str:
    """A time for an explanation; UTC so replay on any machine prints the same words."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(ts))


def gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
