"""Step 5 of a request's path, `http -> request -> admission -> scheduling -> relay`: the attempts.

`walk` decides, purely, which endpoint to try next and what the client hears when none
answered; `upstream` makes one attempt (`_send` the request and triage the status, then
`_answer_whole` or `_relay` the stream event by event); `circuit` is the passive
per-endpoint breaker fed by real traffic, given one verdict per attempt.

Mid-stream migration (issue #21, not built) goes here: a stream cut by a dying engine
continues on another replica. `continuation.py` will hold the per-kind rule that turns
what was streamed into a continuation request (chat: the assistant text so far;
completions: prompt plus text; `max_tokens` lowered; none for structured output), read
as `ApiKind.continuation` next to `kinds.StreamRule`. `upstream._relay` will keep the
deltas it forwards, and the two places that end a started stream in band today
(`_stream_ended` cut short, and `attempt`'s `except` once `ex.started`) will hand back
a resume instead. `walk.Walk` will allow that one "resume" attempt after the first byte.
"""
