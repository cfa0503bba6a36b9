"""A rolling update as operators see it: `llmgw explain` and `llmgw get replicas`."""

from llmgw.opcli import get, output
from llmgw.opcli.explain import render


def decision(seq: int, rid: str, node: str) -> dict:
    return {
        "seq": seq,
        "outcome": "decided",
        "replica_id": rid,
        "based_on_seq": seq - 1,
        "assignments": [{"shard_index": 0, "node": node, "gpus": ["G0"]}],
        "verdicts": [],
        "explanation": "",
        "ts": 0.0,
    }


def replica(rid: str, state: str, *, outdated: bool, retired: bool = False) -> dict:
    return {
        "replica_id": rid,
        "model": "m",
        "state": "retired" if retired else state,
        "retired": retired,
        "retired_reason": "rolling update: profile changed since m-r2 was placed"
        if retired
        else "",
        "profile_digest": "aaaa" if outdated or retired else "bbbb",
        "outdated": outdated,
        "shards": [{"node": "a", "url": f"http://a/{rid}", "state": state}],
    }


# Mid-roll: m-r2 drained away, m-r3 (new) ready, m-r4 (new) loading, m-r1 still old.
MID_ROLL = {
    "model": "m",
    "declared": True,
    "desired_replicas": 2,
    "profile": {"engine": "sim", "gpus_per_shard": 1, "shards_per_replica": 1},
    "profile_digest": "bbbb",
    "decisions": [decision(4, "m-r1", "a"), decision(5, "m-r2", "b"), decision(11, "m-r3", "a")]
    + [decision(13, "m-r4", "b")],
    "replicas": [
        replica("m-r1", "ready", outdated=True),
        replica("m-r2", "stopped", outdated=False, retired=True),
        replica("m-r3", "ready", outdated=False),
        replica("m-r4", "loading", outdated=False),
    ],
}


def test_explain_says_a_roll_is_in_progress_and_marks_each_outdated_replica():
    lines = render(MID_ROLL)
    assert lines[1] == "rolling update in progress: 2 of 3 replica(s) on the current profile"
    heads = {line.split()[0]: line for line in lines if line.startswith("m-r")}
    assert heads["m-r1"].endswith("shard 0 on a (G0)  (OUTDATED: placed with an earlier profile)")
    assert "OUTDATED" not in heads["m-r3"] and "OUTDATED" not in heads["m-r4"]
    assert "m-r2" not in heads  # retired: hidden, and never called outdated
    shown = {ln.split()[0]: ln for ln in render(MID_ROLL, show_retired=True) if ln[:3] == "m-r"}
    assert "OUTDATED" not in shown["m-r2"]


def test_explain_says_nothing_of_a_roll_once_every_replica_is_current():
    done = {
        **MID_ROLL,
        "replicas": [replica(r, "ready", outdated=False) for r in ("m-r3", "m-r4")],
    }
    text = "\n".join(render(done))
    assert "rolling update" not in text and "OUTDATED" not in text
    # An API from before this field existed: no claim either way.
    old_api = {**MID_ROLL, "replicas": [{"replica_id": "m-r1", "state": "ready"}]}
    assert "rolling update" not in "\n".join(render(old_api))


def test_get_replicas_has_a_profile_column_that_names_the_outdated_ones():
    unplaced = {"replica_id": "m-r5", "model": "m", "state": "unplaced", "retired": False,
                "profile_digest": "", "outdated": False, "shards": [],
                "explanation": "m-r5 cannot be placed"}  # fmt: skip
    legacy = {**replica("m-r0", "ready", outdated=False), "profile_digest": ""}
    items = MID_ROLL["replicas"] + [unplaced, legacy]
    headers, rows = get.KINDS["replicas"](items)
    text = output.table(headers, rows).splitlines()
    assert text[0].split()[:5] == ["REPLICA", "MODEL", "STATE", "PROFILE", "NODES"]
    profile = {line.split()[0]: line.split()[3] for line in text[1:]}
    assert profile == {
        "m-r1": "outdated",
        "m-r2": "-",  # retired: on its way out whatever it ran
        "m-r3": "current",
        "m-r4": "current",
        "m-r5": "-",  # not placed yet: it will get the current profile
        "m-r0": "-",  # placed before digests were recorded: never rolled
    }
