"""A griffe extension for the API reference: the docstrings' reST roles as code.

The docstrings are written for ``help()`` and Sphinx-style readers
(``:class:`Client```, ``:meth:`~.put```); the site renders them as Markdown, where
a role would show as its raw text.  Each becomes the name it refers to, in code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):`~?\.?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: f"`{m.group(1)}`", obj.docstring.value)
