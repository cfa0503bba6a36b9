"""Step 1 of an event's path, `intake -> state -> store -> controllers`: log to one committed batch.

`consumer` is the leader's loop over the JetStream log (fetch, fold and commit, ack,
with the next fetch already in flight); `batch` folds a batch into the state and commits
it with its stream position; `gate` is open only while the in-memory state equals what
Postgres has committed, so controllers never act on uncommitted state.
"""
