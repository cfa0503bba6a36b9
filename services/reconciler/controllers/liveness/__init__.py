"""Liveness controller: heartbeats in; node unreachable, lost and recovered events out.

`tracker` is the pure rule (silence becomes unreachable, then lost; voice recovers);
`controller` feeds it heartbeats and publishes its verdicts.
"""
