"""What should run: the operator's catalog file, beside the event path (it enters the log).

`spec` parses, validates and diffs a catalog against the log (pure, errors name the
field); `apply` is `llmgw apply`, which publishes only what changed.
"""
