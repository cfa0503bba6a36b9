"""Step 5 of a request's path, `http -> request -> admission -> scheduling -> relay`: the attempts.

`walk` decides, purely, which endpoint to try next and what the client hears when none
answered; `upstream` makes one attempt (connect, triage the status, answer or relay the
stream event by event); `circuit` is the passive per-endpoint breaker fed by real
traffic.
"""
