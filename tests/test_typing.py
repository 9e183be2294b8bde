"""The public API as a type checker and an IDE see it.

``mypy --strict`` over a user's program (tests/typed/uses.py) finds every public
class and verb with the types it must have (not ``Any``: ``Client.put`` is ``int``,
``AsyncClient.put`` a ``Deferred[int]``), refuses the mistakes of
tests/typed/mistakes.py (each line names the error it must get), and finds the
package's own public faces (its ``__init__``, its errors, ``@verb``) clean.  At run
time: every public callable is annotated, and no signature shows an
``<object object at 0x...>``.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorshare
import tensorshare.rl
import tensorshare.sharded
from tensorshare.protocol.messages import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "typed"
FACES = ("tensorshare/__init__.py", "tensorshare/errors.py", "tensorshare/_client/verb.py")


def mypy(*targets: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(HERE / "mypy.ini"), "--cache-dir",
                           str(cache), "--no-error-summary", *targets], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "MYPYPATH": str(ROOT)})


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")  # shared by the runs: the package is read once


def test_a_users_program_type_checks_with_the_types_the_api_promises(cache):
    out = mypy(str(HERE / "uses.py"), *FACES, cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mistakes_are_refused(cache):
    expected = set()
    for number, line in enumerate((HERE / "mistakes.py").read_text().splitlines(), 1):
        match = re.search(r"# E: ([\w-]+)$", line)
        if match:
            expected.add((number, match.group(1)))
    out = mypy(str(HERE / "mistakes.py"), cache=cache)
    found = {(int(m.group(1)), m.group(2)) for m in re.finditer(r"mistakes\.py:(\d+): error: .*\[([\w-]+)\]$",
                                                                  out.stdout, re.M)}
    assert found == expected, out.stdout


def public_callables():
    """``(name, callable)`` of every public function of the package's face and every
    public method and property of its classes."""
    for name in tensorshare.__all__:
        obj = getattr(tensorshare, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member in dir(obj):
                if member.startswith("_") and member not in ("__init__", "__enter__", "__exit__"):
                    continue
                attr = inspect.getattr_static(obj, member, None)
                fn = attr.fget if isinstance(attr, property) else getattr(obj, member)
                if callable(fn):
                    yield f"{name}.{member}", fn
        elif inspect.isfunction(obj):
            yield name, obj


def test_every_public_callable_is_annotated_and_its_defaults_read_well():
    missing = []
    for name, fn in public_callables():
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin's slot wrapper
            continue
        unannotated = [p.name for p in signature.parameters.values()
                       if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
        if signature.return_annotation is inspect.Parameter.empty and not name.endswith("__init__"):
            unannotated.append("return")
        if unannotated:
            missing.append(f"{name}: {unannotated}")
        assert "object at 0x" not in str(signature), f"{name}{signature}"
    assert not missing, "\n".join(missing)


def test_the_sharded_clients_typed_verbs_are_the_ones_it_has():
    """ShardedClient's verbs are set from the declarations at import; the names it
    declares for type checkers must be the same."""
    tree = ast.parse(Path(tensorshare.sharded.__file__).read_text())
    [block] = [node for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
               and any(isinstance(n, ast.Assign) for n in node.body)]
    typed = {target.id for node in block.body if isinstance(node, ast.Assign) for target in node.targets}
    derived = {c.method for c in COMMANDS.values() if c.takes_bin and c.method is not None}
    assert typed == derived
