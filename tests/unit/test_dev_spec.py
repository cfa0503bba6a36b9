"""`llmgw dev`'s flags and its typed ClusterSpec stay one description."""

import argparse
from pathlib import Path

from llmgw.dev import cluster


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cluster.configure(parser)
    return parser.parse_args(list(argv))


def test_every_flag_is_a_spec_field_with_the_same_default(monkeypatch):
    monkeypatch.delenv("LLMGW_VLLM_PYTHON", raising=False)
    parser = argparse.ArgumentParser()
    cluster.configure(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == set(cluster.ClusterSpec.__dataclass_fields__)
    assert cluster.ClusterSpec.from_args(_parse()) == cluster.ClusterSpec()


def test_flags_become_typed_fields():
    spec = cluster.ClusterSpec.from_args(
        _parse("--agents", "3", "--nats-cluster", "3", "--secure", "--catalog", "c.yaml")
    )
    assert (spec.agents, spec.nats_cluster, spec.secure) == (3, 3, True)
    assert spec.catalog == Path("c.yaml")
