"""What the endpoint view says about what it skipped: each problem once, and a
fallback naming a model with no record only once it has stayed missing.

The control plane writes one record per model, one at a time, so a model can
reach the router a few milliseconds before the record of the fallback it
names: warning then reports a broken setup that is merely still arriving
(`llmgw dev` did, on every start). A missing fallback is therefore pending,
logged at debug, for `GRACE_SECONDS`; if its record arrives in that time
nothing more is said, and if not, it is warned about, once. Every other problem
is warned about when it appears, and not again on each later change of the
view while it stays (a router file with any problem is refused at start, so
these come from the control plane).

Pure: the view feeds it each rebuild's problems and runs `judge` when told.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)

# Long enough for the rest of a catalog's records to arrive, short enough that a
# real misconfiguration is in the log before anyone looks for it.
GRACE_SECONDS = 10.0


class ProblemLog:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._said: set[str] = set()  # warned about, and still present
        self._pending: dict[str, float] = {}  # missing fallback -> when first seen

    @property
    def pending(self) -> set[str]:
        return set(self._pending)

    def report(self, problems: Collection[str], missing: Collection[str]) -> float | None:
        """Log what is new in this rebuild's `problems`, of which `missing` name a
        fallback with no record. Returns in how many seconds `judge` should run, or
        None when nothing is pending."""
        now = self.clock()
        for problem in problems:
            if problem in self._said or problem in self._pending:
                continue
            if problem in missing:
                self._pending[problem] = now
                log.debug("endpoint view: pending, its record may not have arrived: %s", problem)
            else:
                self._said.add(problem)
                log.warning("endpoint view: skipped: %s", problem)
        # Forgotten once gone, so a problem that comes back is said again.
        self._said &= set(problems)
        self._pending = {p: at for p, at in self._pending.items() if p in problems}
        return self._next(now)

    def judge(self) -> float | None:
        """Warn about the missing fallbacks pending for the whole grace; returns when
        to judge again, or None."""
        now = self.clock()
        for problem, since in list(self._pending.items()):
            if now - since >= GRACE_SECONDS:
                del self._pending[problem]
                self._said.add(problem)
                log.warning(
                    "endpoint view: skipped: %s (still, %.0fs after it appeared)",
                    problem,
                    now - since,
                )
        return self._next(now)

    def _next(self, now: float) -> float | None:
        if not self._pending:
            return None
        return max(0.0, min(self._pending.values()) + GRACE_SECONDS - now)
