"""Step 4 of an event's path, `intake -> state -> store -> controllers`: the leader acts.

`runtime` is the controller interface and the loop that runs one (level-triggered,
requeue, back-off, in the manner of controller-runtime); `manager` runs the leader's
controllers over committed state. One subpackage per concern, each a pure core beside its
shell: `liveness`, `replicas` (placement and commands), `projection` (the routers' KV
buckets) and `autoscale`.
"""
