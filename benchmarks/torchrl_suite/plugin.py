"""pytest plugin: TorchRL's replay-buffer suite with a TableStorage twin beside every LazyTensorStorage case.

Loaded into a run of TorchRL's own ``test/rb`` (``-p benchmarks.torchrl_suite.plugin``,
as :mod:`benchmarks.torchrl_suite` does).  Wherever the suite parametrizes
``LazyTensorStorage`` (the class, a ``functools.partial`` of it, or a tuple holding
either), the parametrization gains the same value with :class:`SuiteTableStorage`
in its place: ``LazyTensorStorage``'s signature over a fresh table of a
``tensorshare-server`` this run starts.  Only those cases and their
``LazyTensorStorage`` twins run (``--table-all`` runs the rest too); each case's
outcome, time and first line of failure go to the JSON file ``--table-report``
names, with the id of its twin, so the two are compared within one run.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time

import pytest
from _pytest.mark.structures import Mark, ParameterSet
from torchrl.data.replay_buffers.storages import LazyTensorStorage

from tensorshare.torchrl import TableStorage

_TWINS: dict[int, object] = {}  # id(table value) -> the LazyTensorStorage value it stands beside
_KEEP: list = []  # (so that the ids above stay those of live objects)
_NAMES = itertools.count()
_server = None
_clients: dict[int, object] = {}  # pid -> client (a forked child makes its own)
_made: list[str] = []  # tables made by the running case


def _client():
    import tensorshare

    client = _clients.get(os.getpid())
    if client is None:
        client = _clients[os.getpid()] = tensorshare.Client("127.0.0.1", int(os.environ["TORCHRL_SUITE_PORT"]),
                                                            timeout=60)
    return client


class SuiteTableStorage(TableStorage):
    """``LazyTensorStorage(max_size, device=, ndim=)`` over a new table of the run's server."""

    def __init__(self, max_size, *, device="cpu", ndim: int = 1, **_ignored):
        name = f"torchrl-suite/{os.getpid()}/{next(_NAMES)}"
        _made.append(name)
        super().__init__(name, _client(), max_size=max_size, device=device, ndim=ndim)


# -- the twins


def _twin(value):
    """``value`` with SuiteTableStorage where it holds LazyTensorStorage, or None."""
    if value is LazyTensorStorage:
        return SuiteTableStorage
    if isinstance(value, functools.partial) and value.func is LazyTensorStorage:
        twin = functools.partial(SuiteTableStorage, *value.args, **value.keywords)
        _TWINS[id(twin)] = value
        _KEEP.append(twin)
        return twin
    if isinstance(value, ParameterSet):
        values = _twin(tuple(value.values))
        if values is None:
            return None
        return ParameterSet(values, value.marks, None if value.id is None else f"{value.id}-table")
    if isinstance(value, (tuple, list)):
        twins = [_twin(v) for v in value]
        if all(t is None for t in twins):
            return None
        return type(value)(v if t is None else t for v, t in zip(value, twins))
    return None


_TWINS[id(SuiteTableStorage)] = LazyTensorStorage


def _with_twins(mark):
    args = list(mark.args)
    argvalues = args[1] if len(args) > 1 else mark.kwargs.get("argvalues")
    if argvalues is None:
        return mark
    added = [t for t in (_twin(v) for v in argvalues) if t is not None]
    if not added:
        return mark
    kwargs = dict(mark.kwargs)
    new_values = list(argvalues) + added
    if len(args) > 1:
        args[1] = new_values
    else:
        kwargs["argvalues"] = new_values
    ids = kwargs.get("ids")
    if isinstance(ids, (list, tuple)):
        extra = [ids[i] for i, v in enumerate(argvalues) if _twin(v) is not None]
        kwargs["ids"] = list(ids) + [None if i is None else f"{i}-table" for i in extra]
    return Mark(mark.name, tuple(args), kwargs, _ispytest=True)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    for node in metafunc.definition.listchain():
        if getattr(node, "_table_twins", False):
            continue
        node.own_markers[:] = [_with_twins(m) if m.name == "parametrize" else m for m in node.own_markers]
        node._table_twins = True


def _is_table(value) -> bool:
    return value is SuiteTableStorage or (isinstance(value, functools.partial) and value.func is SuiteTableStorage)


def _is_lazy(value) -> bool:
    return value is LazyTensorStorage or (isinstance(value, functools.partial) and value.func is LazyTensorStorage)


def _params(item) -> dict:
    spec = getattr(item, "callspec", None)
    return {} if spec is None else spec.params


def _signature(item) -> tuple:
    """What a case and its twin share: the function and every parameter, a table
    storage counted as the LazyTensorStorage value it stands beside."""
    params = _params(item)
    return (item.nodeid.split("[")[0],
            tuple(sorted((k, id(_TWINS.get(id(v), v))) for k, v in params.items())))


# -- the run


def pytest_addoption(parser):
    group = parser.getgroup("tensorshare TableStorage twins")
    group.addoption("--table-report", help="write each case's outcome here (JSON)")
    group.addoption("--table-all", action="store_true", help="run every case, not only the storage twins")


def pytest_configure(config):
    global _server
    if "TORCHRL_SUITE_PORT" not in os.environ:
        from benchmarks.procs import Server

        _server = Server()
        os.environ["TORCHRL_SUITE_PORT"] = str(_server.port)
    config._table_results = {}
    config._table_twin = {}


def pytest_unconfigure(config):
    global _server
    for client in _clients.values():
        client.close()
    if _server is not None:
        _server.stop()
        _server = None


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    by_signature = {}
    for item in items:
        values = _params(item).values()
        table = any(_is_table(v) for v in values)
        lazy = any(_is_lazy(v) for v in values)
        if table or lazy or config.getoption("--table-all"):
            keep.append(item)
            if lazy:
                by_signature[_signature(item)] = item.nodeid
        else:
            drop.append(item)
    for item in keep:
        if any(_is_table(v) for v in _params(item).values()):
            config._table_twin[item.nodeid] = by_signature.get(_signature(item))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_teardown(item):
    client = _clients.get(os.getpid())
    while _made:
        name = _made.pop()
        if client is not None:
            try:
                client.delete(name)
            except Exception:  # never made (no write), or its server is gone
                pass


def pytest_runtest_logreport(report):
    results = _config.config._table_results if _config.config else None
    if results is None:
        return
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "message": ""})
    entry["seconds"] += report.duration
    if report.when == "call" or report.outcome != "passed":
        if entry["outcome"] == "passed" or report.outcome == "failed":
            entry["outcome"] = report.outcome
    if report.outcome == "failed" and not entry["message"]:
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:300] \
            if (crash is not None or report.longrepr) else ""
    elif report.outcome == "skipped" and not entry["message"]:
        longrepr = report.longrepr
        entry["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[:300]


class _config:
    config = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _config.config = session.config


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    path = config.getoption("--table-report")
    if not path:
        return
    results = config._table_results
    cases = []
    for nodeid, twin in config._table_twin.items():
        own = results.get(nodeid)
        if own is None:  # deselected by -k, or not run
            continue
        cases.append({"id": nodeid, "twin": twin, **own,
                      "twin_outcome": results.get(twin, {}).get("outcome", "missing"),
                      "twin_seconds": results.get(twin, {}).get("seconds")})
    with open(path, "w") as f:
        json.dump({"finished": time.time(), "cases": cases}, f, indent=1)
