"""A shard's fields are mapped from its record to the messages once, by name: the
registration's ShardInfo and the published ShardStatus carry exactly what the
hand-written copies they replace carried."""

from __future__ import annotations

import msgspec

from llmgw import contracts as c
from llmgw.agent.outbox import status_of
from llmgw.agent.state import ShardRecord

ENVELOPE = ("id", "ts")  # new for every message


def populated() -> ShardRecord:
    """A record with every field set to something other than its default."""
    start = c.StartShard(
        key="k2", node="n", shard_id="m-r1-s1", model="m", replica_id="m-r1",
        profile=c.ServingProfile(engine="vllm", model_ref="org/m"), gpus=["G0", "G1"],
    )  # fmt: skip
    return ShardRecord(
        shard_id="m-r1-s1", model="m", replica_id="m-r1", shard_index=1, engine="vllm",
        state=c.ShardState.FAILED, command_key="k2", keys=["k1", "k2"], start=start,
        gpus=["G0", "G1"], port=8101, url="http://10.0.0.1:8101", advertised=False, pid=4242,
        proc_start=99, kernel_boot_id="boot", argv=["vllm", "serve"], log_path="/l",
        launched_at=1.5, stopping=True, stop_grace=3.0, drain_started=2.0,
        drain_deadline=4.0, reason="exited with code 3", exit_code=3,
        output_tail=["a", "b"], max_running=64, kv_events_endpoint="ipc:///s/kv/a.ev",
        kv_replay_endpoint="ipc:///s/kv/a.rp",
        updated_at=5.0,
    )  # fmt: skip


def hand_info(rec: ShardRecord) -> c.ShardInfo:
    """ShardRecord.info as it was written before the mapping by name."""
    return c.ShardInfo(
        shard_id=rec.shard_id, model=rec.model, replica_id=rec.replica_id,
        shard_index=rec.shard_index, state=rec.state, url=rec.url, port=rec.port,
        gpus=list(rec.gpus), pid=rec.pid,
    )  # fmt: skip


def hand_status(node: str, rec: ShardRecord, command_key: str | None = None) -> c.ShardStatus:
    """status_of as it was written before the mapping by name."""
    return c.ShardStatus(
        node=node, shard_id=rec.shard_id, model=rec.model, replica_id=rec.replica_id,
        shard_index=rec.shard_index, state=rec.state, url=rec.url, port=rec.port,
        gpus=list(rec.gpus),
        command_key=rec.command_key if command_key is None else command_key,
        reason=rec.reason, exit_code=rec.exit_code, output_tail=list(rec.output_tail),
        max_running=rec.max_running,
    )  # fmt: skip


def fields(msg: msgspec.Struct) -> dict:
    return {k: v for k, v in msgspec.structs.asdict(msg).items() if k not in ENVELOPE}


def test_registration_info_is_the_hand_written_copy():
    rec = populated()
    info = rec.info()
    assert info == hand_info(rec)
    assert info.gpus is not rec.gpus  # the message never shares the record's lists


def test_status_is_the_hand_written_copy_for_its_own_key_and_for_an_answer():
    rec = populated()
    for key in (None, "k1", ""):
        status = status_of("n", rec, key)
        assert fields(status) == fields(hand_status("n", rec, key))
    status = status_of("n", rec)
    assert status.gpus is not rec.gpus and status.output_tail is not rec.output_tail
    assert c.decode(c.encode(status), c.ShardStatus) == status  # a valid message on the wire


def test_a_record_with_defaults_maps_as_before():
    rec = ShardRecord(shard_id="s", model="m", replica_id="r")
    assert rec.info() == hand_info(rec)
    assert fields(status_of("n", rec)) == fields(hand_status("n", rec))
