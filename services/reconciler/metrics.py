"""Prometheus metrics of the folding half of the reconciler (the actor has its own)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_FOLDED = Counter("llmgw_reconciler_events_folded_total", "Events folded and committed")
EVENTS_SKIPPED = Counter(
    "llmgw_reconciler_events_skipped_total",
    "Redelivered events at or below the stored position, acknowledged without effect",
)
DEAD_LETTERS = Counter(
    "llmgw_reconciler_dead_letters_total", "Events dead-lettered (malformed, unknown, duplicate)"
)
NEVER_FOLDED = Counter(
    "llmgw_reconciler_events_never_folded_total",
    "Events gone from the stream (expired, deleted) before the fold reached them",
)
FOLD_LAG = Gauge(
    "llmgw_reconciler_fold_lag_events", "Events in the log not yet folded (as of the last fetch)"
)
FOLDED_SEQ = Gauge("llmgw_reconciler_folded_seq", "Stream sequence of the last committed event")
LEADER = Gauge("llmgw_reconciler_leader", "1 while this process is the leader, else 0")
LEADER_TERMS = Counter("llmgw_reconciler_leader_terms_total", "Times this process became leader")
BATCH_SECONDS = Histogram(
    "llmgw_reconciler_batch_seconds",
    "Time to fold and commit one batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
