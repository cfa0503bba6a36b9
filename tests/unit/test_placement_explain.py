"""`llmgw explain` output, from the operator API's answer."""

from llmgw.opcli.explain import render

ANSWER = {
    "model": "m",
    "declared": True,
    "desired_replicas": 2,
    "profile": {"engine": "vllm", "gpus_per_shard": 2, "shards_per_replica": 1},
    "decisions": [
        {
            "seq": 12,
            "outcome": "decided",
            "replica_id": "m-r1",
            "based_on_seq": 11,
            "assignments": [{"shard_index": 0, "node": "node-a", "gpus": ["G0", "G1"]}],
            "adopted": False,
            "verdicts": [
                {"node": "node-a", "fits": True, "reason": "chosen for shard 0 (G0,G1); fits"},
                {"node": "node-bb", "fits": False, "reason": "1 free GPU of 8, needs 2"},
            ],
            "explanation": "m-r1 placed on node-a (G0,G1); 1 of 2 nodes fit",
            "ts": 0.0,
        },
        {
            "seq": 13,
            "outcome": "failed",
            "replica_id": "m-r2",
            "based_on_seq": 12,
            "assignments": [],
            "verdicts": [
                {"node": "node-a", "fits": False, "reason": "0 free GPUs of 2, needs 2"},
                {"node": "node-bb", "fits": False, "reason": "lost since 12:01:03 UTC"},
            ],
            "explanation": "m-r2 cannot be placed: no node fits",
            "ts": 0.0,
        },
        {
            "seq": 5,
            "outcome": "decided",
            "replica_id": "m-r0",
            "based_on_seq": 4,
            "assignments": [{"shard_index": 0, "node": "node-bb", "gpus": ["G0"]}],
            "verdicts": [],
            "explanation": "",
            "ts": 0.0,
        },
    ],
    "replicas": [
        {"replica_id": "m-r0", "state": "retired", "retired": True, "retired_reason": "x"},
        {"replica_id": "m-r1", "state": "ready", "retired": False},
    ],
}


def test_explain_names_each_nodes_reason_and_hides_retired_replicas():
    text = "\n".join(render(ANSWER))
    assert "m: 2 replica(s) wanted; engine vllm, 2 GPU(s) per shard x 1 shard(s)" in text
    assert "m-r1  seq 12, based on seq 11" in text
    assert "placed: shard 0 on node-a (G0,G1)" in text and "now: ready" in text
    assert "  + node-a   chosen for shard 0 (G0,G1); fits" in text
    assert "  - node-bb  1 free GPU of 8, needs 2" in text
    assert "m-r2  seq 13, based on seq 12" in text and "NOT PLACED" in text
    assert "  - node-bb  lost since 12:01:03 UTC" in text
    assert "m-r0" not in text and "1 retired replica(s) not shown" in text
    assert "m-r0  seq 5" in "\n".join(render(ANSWER, show_retired=True))
