"""The autoscaler's evaluation period comes from the reconciler's [actor] section."""

import time

from llmgw.reconciler.actor import ActorConfig
from llmgw.reconciler.autoscale_controller import Autoscaler
from llmgw.reconciler.config import ReconcilerConfig, validate
from llmgw.reconciler.controller import Context


def test_the_autoscaler_ticks_as_configured():
    ctx = Context(nc=None, js=None, term=1, gate=None, clock=time.time)
    auto = Autoscaler(ctx, ActorConfig(autoscale_tick=0.25, fold_wait_timeout=7.0))
    assert auto.resync == 0.25
    assert (auto.inner.cfg.tick, auto.inner.cfg.fold_wait_timeout) == (0.25, 7.0)
    assert Autoscaler(ctx, ActorConfig()).resync == 1.0


def test_a_tick_that_is_not_positive_is_refused_naming_the_key():
    (problem,) = validate(ReconcilerConfig(actor=ActorConfig(autoscale_tick=0)))
    assert problem.startswith("actor.autoscale_tick = 0")
