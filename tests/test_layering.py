"""The layering holds: the server never loads torch or the client's internals (a
relay neither: it has a small client of its own), no server module imports another
that imports it back, and the protocol and wire-format modules both ends share load
neither end."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVER_RUN = """
import sys
import msgpack
from tensorshare_server.config import ServerConfig
from tensorshare_server.protocol.session import ServerSession
from tensorshare_server.root import build_state
from tensorshare.wire.frames import FrameDecoder, discard_sink, frame_head

class Outbox:
    congested = False
    def __init__(self): self.data = bytearray()
    def send(self, parts, on_abandon=None, on_written=None):
        for p in parts: self.data += bytes(p)
    send_reply = send
    def reply(self, data): self.data += data
    def withdraw(self, ticket): return False
    def close(self): pass

state = build_state(ServerConfig(zero_copy=False))
out = Outbox()
session = ServerSession(state, out, "layering")
session.connection_made()
blob = msgpack.packb({"v": None, "t": [], "n": 0})
session.data_received(frame_head({"op": "PUT", "id": 1, "bin": "b", "value": blob}, 0)
                      + frame_head({"op": "GET", "id": 2, "bin": "b"}, 0))
codes = [f.header["code"] for f in FrameDecoder(discard_sink).feed(bytes(out.data))]
assert codes == [220, 250, 226], codes
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "tensorshare._client",
                                                                       "tensorshare.client", "tensorshare.async_client")))
print(loaded)
"""

RELAY_RUN = """
import socket, sys, time
import msgpack
from tensorshare_server.app import EmbeddedServer
from tensorshare.protocol.placement import rendezvous, worker_keys
from tensorshare.wire.frames import FrameDecoder, discard_sink, frame_head

if len(sys.argv) > 1:  # a head of several workers (the test started it): the relay follows each
    head, head_port, workers = None, int(sys.argv[1]), int(sys.argv[2])
else:
    head = EmbeddedServer(port=0, zero_copy=False)
    head_port, workers = head.port, 1
relay = EmbeddedServer(port=0, follow=f"127.0.0.1:{head_port}", follow_timeout=10, zero_copy=False)
sock = socket.create_connection(("127.0.0.1", relay.port), timeout=20)
decoder, frames = FrameDecoder(discard_sink), []

def reply(rid):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for frame in frames:
            if frame.header.get("id") == rid:
                frames.remove(frame)
                return frame.header
        frames.extend(decoder.feed(sock.recv(1 << 16)))
    raise AssertionError(f"no reply to {rid}")

assert reply(0)["code"] == 220
blob = msgpack.packb({"v": None, "t": [], "n": 0})
names = [next(n for n in (f"p{i}" for i in range(999)) if rendezvous(n, worker_keys(workers)) == k)
         for k in range(workers)]  # a bin of each worker
requests, expected = [], []
for name in names:
    requests += [{"op": "PUT", "bin": name, "value": blob, "tag": 3},  # forwarded upstream
                 {"op": "PEEK", "bin": name, "tags": True, "incoming": True},  # mirrored, and copies pushed
                 {"op": "LISTEN", "bin": name}]
    expected += [250, 226, 200]
requests += [{"op": "TCREATE", "bin": "t", "spec": {"capacity": 4}},  # a table verb: at the head
             {"op": "TINFO", "bin": "t"}, {"op": "LIST"}, {"op": "GET", "bin": names[-1], "tags": True}]
expected += [250, 200, 212, 226]
headers = []
for rid, request in enumerate(requests, 1):
    sock.sendall(frame_head({"id": rid, **request}, 0))
    headers.append(reply(rid))
assert [h["code"] for h in headers] == expected, headers
assert set(headers[-2]["bins"]) == {*names, "t"}, headers[-2]  # every worker's, merged
assert head is None or head.state.storage.table("t") is not None
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "tensorshare._client",
                                                                       "tensorshare.client", "tensorshare.async_client")))
print(loaded)
"""

SHARED_IMPORT = """
import sys
import tensorshare.protocol.messages, tensorshare.protocol.auth, tensorshare.wire.frames
import tensorshare.protocol.handshake, tensorshare.protocol.items, tensorshare.protocol.retry
import tensorshare.protocol.keepalive, tensorshare.protocol.tls
import tensorshare.wire.description, tensorshare.disk.layout
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("tensorshare_server", "tensorshare._client",
                                                                       "twisted")))
print(loaded)
"""


@pytest.mark.parametrize("script", [SERVER_RUN, RELAY_RUN, SHARED_IMPORT], ids=["server", "relay", "shared-modules"])
@pytest.mark.process
def test_modules_load_only_their_own_layer(script):
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.process
def test_a_relay_of_a_multi_worker_server_loads_neither_torch_nor_the_client():
    """The relay's one connection per worker is its own torch-free client too."""
    from serverproc import ServerProcess

    head = ServerProcess("--workers", "2", "--no-zero-copy")
    try:
        out = subprocess.run([sys.executable, "-c", RELAY_RUN, str(head.port), "2"], capture_output=True, text=True,
                             timeout=60)
    finally:
        head.stop()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for type
    checkers only, which never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, is_package: bool, known: set[str], everywhere: bool = False) -> set[str]:
    """The modules of ours that module ``name`` imports when it is loaded (its top-level
    imports: one inside a function runs later, when the modules are loaded), or with
    ``everywhere``, anywhere in it (but for type checkers)."""
    base = name if is_package else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in _runtime_nodes(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1]) + (f".{node.module}" if node.module else "")
            else:
                target = node.module
            for alias in node.names:  # `from package import module` imports the module
                if f"{target}.{alias.name}" in EXTENSIONS:  # a compiled one (no imports of ours), not the package
                    continue
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return (found & known) - {name}


def _extensions() -> set[str]:
    """The dotted names of our C extensions (setup.py builds ``server/.../_name.c``)."""
    root = Path(__file__).resolve().parent.parent / "server"
    return {".".join(("tensorshare_server", *path.relative_to(root).with_suffix("").parts))
            for path in root.rglob("*.c")}


EXTENSIONS = _extensions()


def _our_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the client package and the server: ``{dotted name: (path, is_package)}``."""
    root = Path(__file__).resolve().parent.parent
    modules = {}
    for package, directory in (("tensorshare", root / "tensorshare"), ("tensorshare_server", root / "server")):
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            modules[".".join((package, *parts)).removesuffix(".__init__")] = (path, parts[-1] == "__init__")
    return modules


def test_our_modules_are_every_module_of_both_packages():
    modules = _our_modules()
    assert modules["tensorshare.protocol.engine"][1] is False and modules["tensorshare._client"][1] is True
    assert "tensorshare_server.relay.upstream" in modules and len(modules) > 100


def test_no_module_imports_one_that_imports_it_back():
    """Over the client package and the server, deferred imports included (the command
    line and its tables module, the value codec and the device package imported each
    other from inside functions)."""
    modules = _our_modules()
    graph = {name: _imports(name, path, is_package, set(modules), everywhere=True)
             for name, (path, is_package) in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return False

    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert circles == [], circles


def test_the_operations_pages_read_the_storage_through_its_view():
    """server/ops/ reads bins and tables through ``Storage.view`` (server/bins/view.py),
    a read-only summary, and the receive pool through its public figure: not through
    the store's items and accounting fields, the tables' entries or a private field
    (whose rename would have shown 0 without a word)."""
    root = Path(__file__).resolve().parent.parent / "server" / "ops"
    private = {"store", "walk", "table_entries", "resident_bytes", "in_flight_bytes", "description_bytes"}
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (node.attr in private or node.attr.startswith("_held")):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Constant) and node.value == "_held":  # getattr(pool, "_held")
                found.append(f"{path.name}:{node.lineno} '_held'")
    assert found == [], found


# The modules outside a private package that may import it: the package's public faces.
PRIVATE_FACES = {"tensorshare._client": {"tensorshare.client", "tensorshare.async_client"}}


def _private_root(module: str) -> str | None:
    """``a.b._c`` for a module at or under a private ``a.b._c``; None for a public one."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[: i + 1])
    return None


def test_no_module_imports_another_packages_private_module():
    """A private module (a name part starting with ``_``) is imported only by its own
    package's modules, and ``tensorshare._client`` only by the clients that are its
    public faces: everything else uses their public names."""
    modules = _our_modules()
    offences = []
    for name, (path, is_package) in modules.items():
        for imported in _imports(name, path, is_package, set(modules), everywhere=True):
            private = _private_root(imported)
            if private is None or name == private or name.startswith(private + "."):
                continue
            owner = private.rpartition(".")[0]
            faces = PRIVATE_FACES.get(private)
            allowed = name in faces if faces is not None else name.rpartition(".")[0] == owner
            if not allowed:
                offences.append(f"{name} imports {imported}")
    assert offences == [], "\n".join(sorted(offences))
