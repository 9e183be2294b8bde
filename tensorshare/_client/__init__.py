"""Client internals shared by :class:`tensorshare.Client` and
:class:`tensorshare.AsyncClient` (see docs/design.md, "The clients")."""
