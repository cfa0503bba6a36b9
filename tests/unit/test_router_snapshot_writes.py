"""A worker's snapshot file only ever moves forward: a write that finishes late (its
thread stuck on a slow disk past the wait at stop) does not replace the final one, so
the parent never reads a dead worker's counters going backwards, and no temporary file
is left behind either way."""

from __future__ import annotations

import os

from llmgw.router.http import snapshots


def _snap(count: int) -> snapshots.Snapshot:
    return snapshots.Snapshot(
        pid=os.getpid(),
        written_at=float(count),
        ready=True,
        metrics={"requests": [[[], count]]},
        endpoints=[],
    )


def test_a_late_older_write_does_not_replace_a_newer_snapshot(tmp_path):
    writer = snapshots.Writer(tmp_path, lambda: _snap(0))
    writer._write(_snap(7), seq=2)  # the final flush
    writer._write(_snap(5), seq=1)  # the stuck periodic write, finishing after it
    [(snap, alive)] = snapshots.read_all(tmp_path)
    assert alive and snap.metrics == {"requests": [[[], 7]]}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"worker-{os.getpid()}.snap"]


def test_flush_writes_what_the_worker_holds_now(tmp_path):
    counts = iter([3, 9])
    writer = snapshots.Writer(tmp_path, lambda: _snap(next(counts)))
    writer.flush()
    writer.flush()
    [(snap, _)] = snapshots.read_all(tmp_path)
    assert snap.metrics == {"requests": [[[], 9]]}


def test_a_write_to_a_vanished_directory_is_dropped_quietly(tmp_path):
    gone = tmp_path / "gone"
    writer = snapshots.Writer(gone, lambda: _snap(1))
    writer.flush()  # the parent removed the directory at shutdown: no error for the worker
    assert not gone.exists()
