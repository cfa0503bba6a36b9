"""llmgw.reconciler: folds the event log into Postgres, places replicas, explains decisions."""
