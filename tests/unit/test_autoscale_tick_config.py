"""The autoscaler's evaluation period comes from the reconciler's [actor] section."""

import math
import time

import pytest

from llmgw.reconciler.config import ReconcilerConfig, validate
from llmgw.reconciler.controllers.autoscale.controller import AutoscaleController
from llmgw.reconciler.controllers.manager import ActorConfig
from llmgw.reconciler.controllers.runtime import Context


def test_the_autoscaler_ticks_as_configured():
    ctx = Context(nc=None, js=None, term=1, gate=None, clock=time.time)
    auto = AutoscaleController(ctx, ActorConfig(autoscale_tick=0.25, fold_wait_timeout=7.0))
    assert auto.resync == 0.25
    assert (auto.resync, auto.cfg.fold_wait_timeout) == (0.25, 7.0)
    assert AutoscaleController(ctx, ActorConfig()).resync == 1.0


@pytest.mark.parametrize("tick", [0, -1, math.inf, math.nan])
def test_a_tick_that_is_not_a_positive_number_is_refused_naming_the_key(tick):
    (problem,) = validate(ReconcilerConfig(actor=ActorConfig(autoscale_tick=tick)))
    assert problem.startswith(f"actor.autoscale_tick = {tick}")
