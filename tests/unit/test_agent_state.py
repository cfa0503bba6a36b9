"""The state dir: records survive a restart, one agent per dir, process identity via /proc."""

import os
import subprocess
import sys

import pytest

from llmgw import contracts as c
from llmgw.agent import procs
from llmgw.agent.state import ShardRecord, StateDir, StateDirBusy, file_name, tail


def record(shard_id="s1", state=c.ShardState.READY, **kw) -> ShardRecord:
    return ShardRecord(shard_id=shard_id, model="m", replica_id="r", state=state, **kw)


def test_records_round_trip(tmp_path):
    sd = StateDir(tmp_path).open()
    try:
        cmd = c.StartShard(
            key="k", node="n", shard_id="s1", model="m", replica_id="r",
            profile=c.ServingProfile(engine="sim"), gpus=["g0"],
            # A re-adopted or relaunched engine keeps its place in a disaggregated model.
            role="decode", connector=c.ConnectorSpec(shared_path="/kv", extra={"n": 2}),
        )  # fmt: skip
        sd.save(record(keys=["k"], start=cmd, pid=123, port=8100, drain_deadline=5.0))
        sd.save(record("org/model:shard 2", state=c.ShardState.FAILED, reason="boom"))
        got = {r.shard_id: r for r in sd.load_all()}
        assert got["s1"].start == cmd and got["s1"].start.connector.extra == {"n": 2}
        assert got["s1"].pid == 123 and got["s1"].keys == ["k"]
        assert got["org/model:shard 2"].reason == "boom" and got["org/model:shard 2"].terminal
        assert got["s1"].info().state is c.ShardState.READY
    finally:
        sd.close()


def test_an_unreadable_record_is_skipped(tmp_path):
    sd = StateDir(tmp_path).open()
    try:
        sd.save(record())
        (sd.shards / "broken.json").write_text("{not json")
        assert [r.shard_id for r in sd.load_all()] == ["s1"]
    finally:
        sd.close()


def test_one_agent_per_state_dir(tmp_path):
    first = StateDir(tmp_path).open()
    try:
        with pytest.raises(StateDirBusy, match="in use by another agent"):
            StateDir(tmp_path).open()
    finally:
        first.close()
    StateDir(tmp_path).open().close()  # free again once the first closed


def test_prune_keeps_live_shards_and_the_newest_finished(tmp_path):
    sd = StateDir(tmp_path).open()
    try:
        recs = [record("live")]
        for i in range(5):
            recs.append(record(f"done-{i}", state=c.ShardState.STOPPED))
        for r in recs:
            sd.save(r)
        dropped = sd.prune(sd.load_all(), keep=2)
        assert sorted(r.shard_id for r in dropped) == ["done-0", "done-1", "done-2"]
        assert sorted(r.shard_id for r in sd.load_all()) == ["done-3", "done-4", "live"]
    finally:
        sd.close()


def test_file_names_are_safe():
    assert file_name("../../etc/passwd") == "_.._etc_passwd"
    assert file_name("org/model:v1") == "org_model_v1"


def test_tail_reads_the_last_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail(log, 3) == ["line 997", "line 998", "line 999"]
    assert tail(tmp_path / "missing.log", 3) == []


def test_process_identity():
    me = procs.process_start(os.getpid())
    boot = procs.kernel_boot_id()
    assert me is not None and boot
    assert procs.is_alive(os.getpid(), me, boot)
    assert not procs.is_alive(os.getpid(), me + 1, boot)  # a reused pid is not our engine
    assert not procs.is_alive(os.getpid(), me, "another-boot")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert procs.process_start(child.pid) is None


def test_signal_group_reports_a_missing_group():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        assert procs.group_alive(child.pid)
    finally:
        procs.signal_group(child.pid, 9)
        child.wait()
    assert not procs.group_alive(child.pid)
