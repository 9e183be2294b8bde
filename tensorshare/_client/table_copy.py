"""The blocking client's table checkpoints (``save`` of a table, ``load_table``), over :mod:`tensorshare.table_copy`."""

from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import BadNameError, NoSuchBinError
from ..table_copy import load_table, save_table
from .options import DEFAULT, Timeout


class TableCopies:
    """The blocking client's table checkpoints: ``save`` of a table, ``load_table``."""

    def save(self, bin: str, path: str | os.PathLike[str], *, overwrite: bool = False, timeout: Timeout = DEFAULT,
             progress: Callable[[int, int], Any] | None = None) -> int:
        """Write bin ``bin``'s items to the directory ``path`` (see
        :meth:`ClientMethods.save`); for a table, a table checkpoint of its rows and
        settings (:mod:`tensorshare.disk.tables`, which :meth:`load_table` makes the
        table again from).  Returns the number of items (or rows) saved."""
        try:
            return super().save(bin, path, overwrite=overwrite, timeout=timeout, progress=progress)
        except BadNameError:
            if not self._is_table(bin):
                raise
        return save_table(self, bin, path, overwrite=overwrite)

    def load_table(self, path: str | os.PathLike[str], name: str | None = None, *, replace: bool = True) -> int:
        """Make table ``name`` (the saved one's name by default) from the table
        checkpoint ``path`` that :meth:`save` wrote: the same settings and rows, each
        at its slot with its priority.  A table there is replaced (``replace=False``:
        refused).  Returns the number of rows."""
        return load_table(self, path, name, replace=replace)

    def _is_table(self, name: str) -> bool:
        try:
            self.table_info(name)
        except (BadNameError, NoSuchBinError):
            return False
        return True
