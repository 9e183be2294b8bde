"""Bins spread over several servers: :class:`ShardedClient`, routed on the client side.

Each bin lives on one server, chosen by rendezvous (highest random weight)
hashing of the bin name with each server's address: every client that is given
the same server list picks the same server for a bin, with no coordinator, and
adding a server to a list of n moves only the bins that now hash highest to it
(about 1/(n+1) of them); removing one moves only its own bins.  A bin's verbs go
to its server unchanged, so every guarantee of one server (atomic items, ``seq``,
listens, ``--data-dir`` durability) holds per bin; a table is a bin, so its verbs
go to its server the same way.  :meth:`ShardedClient.list` merges the listings of
all servers.  Nothing spans two bins, as on one server.

The per-bin methods are derived from the verbs' declarations
(``tensorshare/protocol/messages.py``): every verb that names a bin gives
``ShardedClient`` the method its declaration names, which calls that method of the
bin's server's :class:`~tensorshare.Client`.
"""

from __future__ import annotations

import builtins
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .client import DEFAULT, Client, Timeout
from .errors import UsageError
from .protocol.messages import COMMANDS, Command
from .protocol.placement import rendezvous



def parse_server(server: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` as ``(host, port)``."""
    if isinstance(server, tuple) and len(server) == 2:
        host, port = server
    elif isinstance(server, str):
        host, sep, port = server.rpartition(":")
        if not sep:
            raise UsageError(f"a server is 'host:port', not {server!r}")
        host = host.strip("[]")
    else:
        raise UsageError(f"a server is 'host:port' or (host, port), not {server!r}")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise UsageError(f"bad port in {server!r}") from None
    if not host or not 0 < port < 65536:
        raise UsageError(f"bad server address {server!r}")
    return host, port


class ShardedClient:
    """A :class:`~tensorshare.Client` over several servers, each bin on one of them.

    >>> client = ShardedClient(["host1:8000", "host2:8000"], timeout=30, token=...)
    >>> client.put("params", state_dict)          # on the server "params" hashes to
    >>> client.list()                             # every server's bins, merged

    ``client_options`` go to each server's :class:`Client`.  A server that is
    down fails the calls for its own bins (the others carry on); its client
    reconnects as any :class:`Client` does.  The servers' order does not matter;
    their addresses, as given, are the hash keys: give every client the same
    spelling.
    """

    def __init__(self, servers: Iterable[str | tuple[str, int]], **client_options: Any) -> None:
        addresses = [parse_server(server) for server in servers]
        if not addresses:
            raise UsageError("ShardedClient needs at least one server")
        self.keys = [f"{host}:{port}" for host, port in addresses]
        if len(set(self.keys)) != len(self.keys):
            raise UsageError(f"a server is listed twice: {self.keys}")
        self.clients: list[Client] = []
        try:
            for host, port in addresses:
                self.clients.append(Client(host, port, **client_options))
        except BaseException:
            self.close()
            raise

    def server_for(self, bin: str) -> str:
        """The ``host:port`` that holds ``bin``."""
        return self.keys[rendezvous(bin, self.keys)]

    def client_for(self, bin: str) -> Client:
        """The :class:`Client` of the server that holds ``bin``."""
        return self.clients[rendezvous(bin, self.keys)]

    # -- the verbs of one bin go to its server (and the methods derived from the declarations, below)

    def save(self, bin: str, path: str | os.PathLike[str], **options: Any) -> int:
        return self.client_for(bin).save(bin, path, **options)

    def submit(self, op: str | Command, bin: str, *args: Any, **options: Any) -> None:
        """:meth:`Client.submit` on ``bin``'s server (every verb that names a bin)."""
        if bin is None:
            raise UsageError("ShardedClient.submit needs a bin (it picks the server)")
        self.client_for(bin).submit(op, bin, *args, **options)

    def update_priorities_nowait(self, name: str, *args: Any, **options: Any) -> None:
        """:meth:`Client.update_priorities_nowait` on the server that holds table ``name``."""
        self.client_for(name).update_priorities_nowait(name, *args, **options)

    def shared(self, value: Any, bin: str) -> Any:
        """:meth:`Client.shared` for a value that will be put into ``bin``."""
        return self.client_for(bin).shared(value)

    if TYPE_CHECKING:  # the verbs set below, as type checkers see them (tests/test_typing.py checks the list)
        put = Client.put
        append = Client.append
        get = Client.get
        peek = Client.peek
        delete = Client.delete
        listen = Client.listen
        unlisten = Client.unlisten
        create_table = Client.create_table
        insert = Client.insert
        sample = Client.sample
        update_priorities = Client.update_priorities
        write = Client.write
        read = Client.read
        table_info = Client.table_info
        set_table_limits = Client.set_table_limits

    # -- all servers

    def list(self, pattern: str | None = None, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """``{bin: n_items}`` of every server, merged (asked in parallel); ``pattern``:
        as :meth:`Client.list`."""
        kwargs: dict[str, Any] = {} if timeout is DEFAULT else {"timeout": timeout}
        kwargs["pattern"] = pattern
        merged: dict[str, int] = {}
        for listing in self._each(lambda client: client.list(**kwargs)):
            merged.update(listing)
        return merged

    def ping(self, timeout: Timeout = DEFAULT) -> builtins.list[float]:  # (list: the method above)
        """Round-trip times to each server, in the order given."""
        kwargs = {} if timeout is DEFAULT else {"timeout": timeout}
        return self._each(lambda client: client.ping(**kwargs))

    def _each(self, fn: Callable[[Client], Any]) -> list:
        if len(self.clients) == 1:
            return [fn(self.clients[0])]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            return list(pool.map(fn, self.clients))

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedClient({self.keys!r})"


def _on_the_bins_server(method: str) -> Callable:
    def call(self: ShardedClient, bin: str, *args: Any, **options: Any) -> Any:
        return getattr(self.client_for(bin), method)(bin, *args, **options)

    functools.update_wrapper(call, getattr(Client, method))  # Client's signature, for help() and IDEs
    call.__qualname__ = f"ShardedClient.{method}"
    call.__doc__ = f":meth:`Client.{method}` on the server that holds ``bin``."
    return call


for _command in COMMANDS.values():
    if _command.takes_bin and _command.method is not None:
        setattr(ShardedClient, _command.method, _on_the_bins_server(_command.method))


__all__ = ["ShardedClient", "rendezvous", "parse_server"]
