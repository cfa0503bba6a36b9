"""Step 5 of a request's path, `http -> request -> admission -> scheduling -> relay`: the attempts.

`walk` decides, purely, which endpoint to try next and what the client hears when none
answered; `upstream` makes one attempt (`_send` the request and triage the status, then
`_answer_whole` or `_relay` the stream event by event); `circuit` is the passive
per-endpoint breaker fed by real traffic, given one verdict per attempt;
`continuation` is mid-stream migration's rule (what a stream sent, and the request
that continues it on another replica), read as `ApiKind.continuation`: `upstream`
feeds it what it relays and hands back a `resume` failure when a started stream
breaks, and `walk` gives that continuation its attempts on the same model.
`disagg` is a disaggregated model's prefill leg (its attempts on the prefill pool) and
the body each decode attempt sends; the decode leg is then an attempt like any other.
"""
