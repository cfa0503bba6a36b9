"""The leader lock's session limits: a cut-off leader steps down before the server frees it."""

from llmgw.reconciler import leader
from llmgw.reconciler.config import LeaderConfig, ReconcilerConfig, validate


def test_the_lock_session_is_ended_by_the_server_after_the_timeout():
    settings = leader.session_settings("cp-1", 10.0)
    assert settings["application_name"] == "llmgw-leader:cp-1"
    assert settings["idle_session_timeout"] == "10000"  # ms
    assert settings["tcp_user_timeout"] == "10000"
    assert int(settings["tcp_keepalives_idle"]) * 3 <= 10


def test_a_session_timeout_shorter_than_three_checks_is_refused():
    short = ReconcilerConfig(
        leader=LeaderConfig(check_interval_seconds=2.0, session_timeout_seconds=5.0)
    )
    (problem,) = validate(short)
    assert problem.startswith("leader.session_timeout_seconds = 5.0")
    assert validate(ReconcilerConfig()) == []
