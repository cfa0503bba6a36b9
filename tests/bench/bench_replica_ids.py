"""The next replica id on a long-lived state: 50 models x 2,000 scale cycles = 100k replicas.

    .venv/bin/python tests/bench/bench_replica_ids.py [--models 50] [--cycles 2000]

Replicas are never removed (a retired one keeps its id), so a fleet that has
scaled up and down for months holds many times more replicas than it runs.
`queries.next_replica_id` is asked on every reconcile pass for each model that
misses replicas, and by the KV projection for every model below its count: it
must not cost more as that history grows. Figures: the fold of the history,
the first call after a load from the tables (the one that reads every replica
once), then per call on the folded state, on the loaded one, and while the
fold keeps placing replicas between calls. Target: <= 50 us per call.
"""

from __future__ import annotations

import argparse
import time

from llmgw import contracts as c
from llmgw.reconciler.state import fold, ids, queries
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import rows

TARGET_PER_CALL = 50e-6


def history(models: int, cycles: int) -> tuple[ClusterState, list[str]]:
    """Each cycle places one replica of each model and retires it again."""
    names = [f"org/model-{m}" for m in range(models)]
    state = ClusterState()
    seq = 0
    for name in names:
        seq += 1
        fold.apply(state, seq, c.ModelDeclared(name=name, replicas=1))
    for n in range(1, cycles + 1):
        for name in names:
            rid = ids.replica_id(name, n)
            seq += 1
            fold.apply(
                state,
                seq,
                c.PlacementDecided(model=name, replica_id=rid, based_on_seq=0, assignments=[]),
            )
            seq += 1
            retired = c.ReplicaRetired(model=name, replica_id=rid, based_on_seq=0, reason="down")
            fold.apply(state, seq, retired)
    return state, names


def per_call(state: ClusterState, names: list[str], rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        for name in names:
            queries.next_replica_id(state, name)
    return (time.perf_counter() - started) / (rounds * len(names))


def interleaved(state: ClusterState, names: list[str], rounds: int) -> float:
    """Per call while the fold places a replica of the same model between calls."""
    seq = state.last_seq
    spent = 0.0
    for _ in range(rounds):
        for name in names:
            started = time.perf_counter()
            rid = queries.next_replica_id(state, name)
            spent += time.perf_counter() - started
            seq += 1
            fold.apply(
                state,
                seq,
                c.PlacementDecided(model=name, replica_id=rid, based_on_seq=0, assignments=[]),
            )
    return spent / (rounds * len(names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=20, help="calls per model per figure")
    args = ap.parse_args()

    started = time.perf_counter()
    state, names = history(args.models, args.cycles)
    folded_s = time.perf_counter() - started
    print(f"fold of the history: {len(state.replicas)} replicas in {folded_s:.2f}s")

    table_rows = {name: list(by_key.values()) for name, by_key in rows.all_rows(state).items()}
    loaded = rows.state_from_rows(table_rows, state.last_seq)
    started = time.perf_counter()
    first = queries.next_replica_id(loaded, names[0])
    first_s = time.perf_counter() - started
    assert first == queries.next_replica_id(state, names[0]), "loaded state disagrees"
    print(f"first call after a load from the tables: {first_s * 1e3:.2f} ms")

    figures = {
        "folded state": per_call(state, names, args.rounds),
        "loaded state": per_call(loaded, names, args.rounds),
        "fold between calls": interleaved(state, names, args.rounds),
    }
    for what, seconds in figures.items():
        print(f"per call, {what}: {seconds * 1e6:.1f} us")
    worst = max(figures.values())
    ok = worst <= TARGET_PER_CALL
    print(
        f"{'PASS' if ok else 'FAIL'}: worst per call {worst * 1e6:.1f} us "
        f"(target <= {TARGET_PER_CALL * 1e6:.0f} us) over {len(state.replicas)} replicas"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
