"""The ``@verb`` decorator: one method, two result types, as type checkers see them.

The verbs are written once (``_client/methods.py``, ``_client/tables.py``) for both
clients: :class:`tensorshare.Client` answers a call with its result,
:class:`tensorshare.AsyncClient` with a Deferred of it.  A verb is annotated with
what the blocking client returns (``-> int``); ``@verb`` tells type checkers that
the same method of an ``AsyncClient`` returns ``Deferred[int]``, with the same
parameters.  At run time it is nothing: the method itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Concatenate, Generic, ParamSpec, TypeVar

__all__ = ["verb"]

P = ParamSpec("P")
R = TypeVar("R")

if TYPE_CHECKING:
    from typing import overload

    from twisted.internet.defer import Deferred

    from ..async_client import AsyncClient

    class verb(Generic[P, R]):
        def __init__(self, method: Callable[Concatenate[Any, P], R]) -> None: ...

        @overload
        def __get__(self, client: None, owner: type) -> verb[P, R]: ...

        @overload
        def __get__(self, client: AsyncClient, owner: type) -> Callable[P, Deferred[R]]: ...

        @overload
        def __get__(self, client: object, owner: type) -> Callable[P, R]: ...

        def __get__(self, client: object, owner: type) -> Any: ...

        def __call__(self, client: Any, *args: P.args, **kwargs: P.kwargs) -> R: ...
else:
    def verb(method):
        return method
