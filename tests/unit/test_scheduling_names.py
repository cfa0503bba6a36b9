"""The scheduling plugin names the contract gives the catalog are the router's own."""

from llmgw import contracts as c
from llmgw.router.scheduling import pipeline


def test_the_contract_names_every_scheduling_plugin_the_router_has():
    # Order carries no meaning: the catalog lists the names, the router looks them up.
    assert set(c.FILTER_NAMES) == set(pipeline.FILTERS)
    assert set(c.SCORER_NAMES) == set(pipeline.SCORERS)
    assert set(c.PICKER_NAMES) == set(pipeline.PICKERS)


def test_the_default_scheduling_names_only_known_plugins():
    spec = c.SchedulingSpec()
    assert set(spec.filters) <= set(c.FILTER_NAMES)
    assert set(spec.scorers) <= set(c.SCORER_NAMES)
    assert spec.picker in c.PICKER_NAMES
