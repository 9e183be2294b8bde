"""Every declared verb, from its declaration (tensorshare/protocol/messages.py): what is
derived from it is there for each one, and each one round-trips through both ends.

A verb added to the declarations without its handler, its clients' method, its
relay treatment, its zero-copy role, its route to the workers of a multi-worker
server, its errors in PROTOCOL.md or an example request here fails one of these
tests."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from twisted.internet.task import Clock

from pairing import Pair, PairedWorkers
from tensorshare import AsyncClient, Client, ShardedClient
from tensorshare._client.values import Call
from tensorshare._client.connection import NO_VALUE
from tensorshare._client.routing import route
from tensorshare.errors import RemoteError, WrongWorkerError, error_for_code
from tensorshare.protocol.messages import (
    ANY_REQUEST_ERRORS, AUTH, COMMANDS, LANES, TCREATE, WRONG_WORKER, Key, Relay, Route, TableKey, ZeroCopy,
)
from tensorshare.protocol.placement import WorkerMap

PROTOCOL = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
ALL = sorted(COMMANDS.values(), key=lambda c: c.verb)
COLUMNS = {"x": {"shape": [2], "dtype": "float32"}}


@pytest.mark.parametrize("command", ALL, ids=lambda c: c.verb)
def test_every_verb_declares_its_treatment_and_has_its_methods(command):
    assert command.relay in Relay.ALL
    assert command.zero_copy in (None, ZeroCopy.STORE, ZeroCopy.READ, ZeroCopy.TAKE)
    assert command.zero_copy != ZeroCopy.STORE or command.payload  # only a value can go through shared memory
    assert command.lane is None or Key.WAIT in {field.key for field in command.fields}  # it waits: it says how long
    assert command.route in Route.ALL
    assert (command.route == Route.OWNER) == command.takes_bin  # a bin's verbs go to its owner, and only they
    assert (WRONG_WORKER in command.errors) == (command.route == Route.OWNER)  # refused by a worker that is not
    if command is AUTH:  # sent by every client while it connects
        assert command.method is None and command.route == Route.CONNECTION
        return
    for client in (Client, AsyncClient):
        assert callable(getattr(client, command.method, None)), (client, command.method)
    if command.takes_bin:  # a bin's verbs go to its server
        assert callable(getattr(ShardedClient, command.method, None)), command.method


def _entry(verb: str) -> str:
    """The verb's entry in PROTOCOL.md (§4.3 or §12.3), with the entries it refers to ("as PUT")."""
    start = PROTOCOL.index(f"**{verb}** —")
    end = re.search(r"\n\n(\*\*[A-Z]+\*\* —|#)", PROTOCOL[start:])
    text = PROTOCOL[start: start + end.start()]
    for other in re.findall(r"\bas (PUT|TINSERT)\b", text):
        text += _entry(other)
    return text


@pytest.mark.parametrize("command", ALL, ids=lambda c: c.verb)
def test_every_verbs_errors_are_known_codes_said_in_its_protocol_entry(command):
    entry = _entry(command.verb)
    for code in command.errors:
        assert code not in ANY_REQUEST_ERRORS  # those are anyone's: not declared per verb
        assert f"| {code} |" in PROTOCOL and error_for_code(code, "").code == code  # in §6's table
        assert str(code) in entry, f"{command.verb}'s PROTOCOL.md entry does not say when it answers {code}"


class _Areas:
    """What routing asks of a connection's shared areas: one it can map, no incoming directory."""

    usable = [0]
    incoming = None


@pytest.mark.parametrize("command", ALL, ids=lambda c: c.verb)
def test_the_clients_route_each_verb_as_its_zero_copy_role_says(command):
    call = Call(1, command, {Key.BIN: "b"}, NO_VALUE)
    route(call, _Areas())
    asks_for_references = Key.REF in call.fields
    assert asks_for_references == (command.zero_copy in (ZeroCopy.READ, ZeroCopy.TAKE))
    assert (call.fallback is not None) == (command.zero_copy == ZeroCopy.READ)  # sent again over TCP
    assert not asks_for_references or Key.REF in {field.key for field in command.fields}
    if command.taken_with:  # a read that counts its rows (TREAD's sample) is never sent again
        counting = Call(2, command, {Key.BIN: "b", command.taken_with: True}, NO_VALUE)
        route(counting, _Areas())
        assert Key.REF in counting.fields and counting.fallback is None


def test_the_server_handles_every_verb_and_waits_in_each_declared_lane():
    from tensorshare_server.protocol import session  # noqa: F401 - loads the handler modules
    from tensorshare_server.protocol.registry import HANDLERS

    assert set(HANDLERS) == set(COMMANDS.values())
    assert set(LANES) == {c.lane for c in COMMANDS.values() if c.lane is not None}


def _example(verb: str):
    """``(fields, value)`` of a request of ``verb`` that succeeds after the ones before it."""
    b, t = {Key.BIN: "b"}, {Key.BIN: "t"}
    rows = {"x": torch.ones(3, 2)}
    return {
        "PUT": (b, torch.arange(3)), "APPEND": (b, 1.5), "PEEK": (b, NO_VALUE), "LIST": (None, NO_VALUE),
        "LISTEN": (b, NO_VALUE), "UNLISTEN": (b, NO_VALUE), "GET": (b, NO_VALUE), "NOOP": (None, NO_VALUE),
        "DELETE": (b, NO_VALUE),
        "TCREATE": ({**t, TableKey.SPEC: {"capacity": 8, "columns": COLUMNS}}, NO_VALUE),
        "TINSERT": (t, rows), "TWRITE": ({**t, TableKey.INDICES: np.array([5], "<i8").tobytes()}, {"x": torch.ones(1, 2)}),
        "TSAMPLE": ({**t, Key.N: 2}, NO_VALUE), "TREAD": ({**t, TableKey.INDICES: np.array([0, 5], "<i8").tobytes()},
                                                          NO_VALUE),
        "TPRIORITY": ({**t, TableKey.KEYS: np.array([0], "<i8").tobytes(),
                       TableKey.PRIORITIES: np.array([2.0], "<f8").tobytes()}, NO_VALUE),
        "TINFO": (t, NO_VALUE), "TLIMITS": ({**t, TableKey.LIMITS: {"min_size_to_sample": 2}}, NO_VALUE),
    }[verb]


ORDER = ["PUT", "APPEND", "PEEK", "LIST", "LISTEN", "UNLISTEN", "GET", "NOOP", "DELETE",
         "TCREATE", "TINSERT", "TWRITE", "TSAMPLE", "TREAD", "TPRIORITY", "TINFO", "TLIMITS"]


def test_every_verb_round_trips_through_both_ends():
    """Each verb's request as the clients build it passes the server's checks, and its
    success reply passes the clients' (AUTH: in the handshake of a server with a token)."""
    assert set(ORDER) == set(COMMANDS) - {AUTH.verb}
    pair = Pair()
    for verb in ORDER:
        fields, value = _example(verb)
        try:
            reply = pair.call(COMMANDS[verb], fields, value)
        except RemoteError as exc:
            raise AssertionError(f"{verb}: {exc}") from None
        assert reply.header["code"] == COMMANDS[verb].success.code
    pair.close()
    with_token = Pair(token="a token of enough characters to be fine")
    assert with_token.client.ready and with_token.session.authenticated
    assert with_token.call(TCREATE, {Key.BIN: "t", TableKey.SPEC: {"capacity": 1}}).result == 0
    with_token.close()


def test_a_relay_answers_each_verb_as_its_declaration_says():
    """A relay has a handler of its own for every verb it does not answer as any
    server does (forwarded, mirrored, merged); table verbs through a relay reach the
    head (tests/test_relay.py)."""
    from tensorshare_server.protocol.registry import HANDLERS
    from tensorshare_server.relay.forward import relay_handlers

    handlers = relay_handlers()
    assert set(handlers) == {c for c in COMMANDS.values() if c.relay != Relay.LOCAL}
    assert all(handler is not HANDLERS[command] for command, handler in handlers.items())


def test_every_verb_that_changes_a_bin_waits_for_a_relays_mirror():
    """A relay answers a verb declared ``FORWARD`` only once its mirror shows the change
    (read-your-writes: server/relay/forward.py waits by the declaration, whatever the
    handler).  Which verbs change a bin is found here by running each verb's example
    on a server and hearing what its storage tells: a verb that changes a bin declared
    anything else would lose read-your-writes on relays without a word; ``PASS`` (sent
    up and passed back as it came) is for tables, which a relay never mirrors."""
    pair = Pair()
    told: list[str] = []
    pair.state.listeners.watch(told.append)  # every change the storage makes, and every touch
    for verb in ORDER:
        command = COMMANDS[verb]
        fields, value = _example(verb)
        told.clear()
        pair.call(command, fields, value)
        bins = {name for name in told if not pair.state.storage.is_table(name)}
        assert bool(bins) == (command.relay == Relay.FORWARD), (verb, command.relay, bins)
        if command.relay == Relay.PASS:
            assert pair.state.storage.is_table(fields[Key.BIN]), verb
    pair.close()


def _counted(states) -> list[dict]:
    """Each worker's requests so far, by verb."""
    return [{verb: stats.requests for verb, stats in state.counters.verbs.items()} for state in states]


def test_a_multi_worker_client_sends_each_verb_where_its_route_says():
    """Each verb's request from a routed AsyncClient reaches the workers its route
    names (real worker sessions paired in memory) and its reply passes the client's
    checks: its bin's owner alone, every worker for LIST (merged) and NOOP."""
    paired = PairedWorkers(2, Clock(), metrics_port=0)
    client = paired.client()
    for verb in ORDER:
        command = COMMANDS[verb]
        fields, value = _example(verb)
        before = _counted(paired.states)
        paired.run(client._call(command, fields, value, decode=False))
        after = _counted(paired.states)
        reached = [k for k in range(2) if after[k].get(verb, 0) > before[k].get(verb, 0)]
        if command.route == Route.OWNER:
            assert reached == [paired.workers.owner(fields[Key.BIN])], verb
        else:  # MERGE (LIST), EVERY (NOOP: both members are connected)
            assert reached == [0, 1], verb
    paired.run(client.put("b", 1.0))  # (deleted above)
    assert set(paired.run(client.list())) == {"b", "t"}  # merged: the bins (and tables) of both workers
    client.close()


def test_a_worker_refuses_each_verb_naming_another_workers_bin_before_its_handler():
    """A worker answers 427 to every verb routed to a bin's owner when another worker
    owns the bin, with nothing changed; it answers the others itself."""
    from tensorshare_server.config import ServerConfig
    from tensorshare_server.root import build_state

    workers = WorkerMap([9001, 9002, 9003], 0, "run")
    assert workers.owner("b") == workers.owner("t") == 2  # (the example's names: another worker's)
    state = build_state(ServerConfig())
    state.workers = workers
    pair = Pair(state=state)
    for verb in ORDER:
        command = COMMANDS[verb]
        fields, value = _example(verb)
        if command.route == Route.OWNER:
            with pytest.raises(WrongWorkerError, match="worker 2 of 3 owns"):
                pair.call(command, fields, value)
        else:
            assert pair.call(command, fields, value).header["code"] == command.success.code
    assert pair.call(COMMANDS["LIST"]).header[Key.BINS] == {}  # nothing was made
    pair.close()
