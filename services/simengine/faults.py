"""Injected failures: the current fault set and the decisions it implies.

Random decisions use their own seeded generator, so a test that sets an error rate sees the
same sequence of failures on every run.
"""

from __future__ import annotations

import random

from llmgw.simengine.config import FaultConfig
from llmgw.simengine.protocol import ApiError


class Faults:
    def __init__(self, cfg: FaultConfig, seed: int = 0):
        self._rng = random.Random(seed)
        self.config = cfg
        self._completed = 0

    def replace(self, cfg: FaultConfig) -> None:
        """Install a new fault set; `exit_after_requests` counts from now."""
        self.config = cfg
        self._completed = 0

    def injected_error(self) -> ApiError | None:
        rate = self.config.error_rate
        if rate and self._rng.random() < rate:
            status = self.config.error_status
            return ApiError(
                status, f"injected fault: the simulator answers {status}", code="injected_fault"
            )
        return None

    def completed(self) -> bool:
        """Count one completed request; True when the process should now exit."""
        self._completed += 1
        limit = self.config.exit_after_requests
        return limit is not None and self._completed >= limit
