"""The idle and authentication limits decide by the clock alone (server/protocol/timelimits.py)."""

from types import SimpleNamespace

from server.protocol.timelimits import AUTH_EXPIRED, IDLE, KEEPALIVE, TimeLimits

LIMITS = SimpleNamespace(idle_timeout=10.0, auth_timeout=5.0)


def test_an_unauthenticated_connection_expires_at_auth_timeout_before_any_idle_limit():
    limits = TimeLimits()
    assert limits.due(100.0, False, LIMITS, authenticated=False, listening=False) is None
    limits.heard = True  # bytes came: no matter, authentication has its own clock
    assert limits.due(104.9, False, LIMITS, authenticated=False, listening=False) is None
    assert limits.due(105.0, False, LIMITS, authenticated=False, listening=False) == AUTH_EXPIRED
    assert TimeLimits().due(105.0, False, SimpleNamespace(idle_timeout=0, auth_timeout=0), False, False) is None


def test_quiet_for_idle_timeout_closes_unless_bytes_or_replies_moved():
    limits = TimeLimits()
    limits.due(0.0, False, LIMITS, authenticated=True, listening=False)
    limits.heard = True  # bytes came: the quiet starts again at the next look
    assert limits.due(8.0, False, LIMITS, authenticated=True, listening=False) is None
    assert limits.due(17.5, False, LIMITS, authenticated=True, listening=False) is None
    assert limits.due(18.0, False, LIMITS, authenticated=True, listening=False) == IDLE
    limits = TimeLimits()
    limits.due(0.0, False, LIMITS, authenticated=True, listening=False)
    assert limits.due(8.0, True, LIMITS, authenticated=True, listening=False) is None  # a reply still going out
    assert limits.due(17.5, False, LIMITS, authenticated=True, listening=False) is None
    assert limits.due(18.0, False, LIMITS, authenticated=True, listening=False) == IDLE


def test_a_quiet_listener_gets_a_keepalive_every_idle_timeout_and_is_kept():
    limits = TimeLimits()
    limits.due(0.0, False, LIMITS, authenticated=True, listening=True)
    assert limits.due(10.0, False, LIMITS, authenticated=True, listening=True) == KEEPALIVE
    assert limits.due(15.0, False, LIMITS, authenticated=True, listening=True) is None
    assert limits.due(20.0, False, LIMITS, authenticated=True, listening=True) == KEEPALIVE
    limits.heard = True  # it spoke: the next keepalive is a whole idle_timeout of silence away
    assert limits.due(21.0, False, LIMITS, authenticated=True, listening=True) is None
    assert limits.due(30.9, False, LIMITS, authenticated=True, listening=True) is None
    assert limits.due(31.0, False, LIMITS, authenticated=True, listening=True) == KEEPALIVE
