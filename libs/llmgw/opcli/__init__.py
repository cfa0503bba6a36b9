"""Operator CLI commands that read the reconciler's API or the event log (`llmgw get`, ...)."""
