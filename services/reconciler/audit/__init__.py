"""Does the log explain the state? Beside the event path, read by operators.

`replay` re-folds the log and asks whether today's code decides the same; `verify` checks
the live tables equal a replay from seq 1; `rebuild` rewrites them from the archive;
`cli` and `replay_cli` are `llmgw audit`.
"""
