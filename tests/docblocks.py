"""The code blocks and error messages of the user documentation, as the tests that check them read them.

Every fenced ``bash``, ``python`` and ``toml`` block of README.md, the site's home
page, its quickstart and its guides (:data:`DOCUMENTS`) is checked by a test
(tests/test_doc_blocks.py, tests/test_install.py); the table of messages of
docs/guides/errors.md by tests/test_messages.py.  An HTML comment on the line
before a block says how (invisible on a rendered page):

* none: run it as written (Python against a server, each shell line as a command);
* ``<!-- check: NAME -->``: run it with what the text around it supplies
  (the objects a fragment uses, a relay to read from...): ``NAME`` is a check of
  tests/test_doc_blocks.py, or ``install`` (tests/test_install.py);
* ``<!-- check: runs until stopped; prints "TEXT" -->``: it serves until stopped:
  the test runs it, waits for TEXT and stops it;
* ``<!-- check: needs WHAT -->``: it needs what a test cannot have (a GPU, a Ray
  cluster, a host of that name...); the test lists it as not run, with the reason.

Blocks are run with the documents' addresses and paths replaced by the test's own
(:data:`ADDRESSES`, :data:`PATHS`): its ports, its temporary directories, loopback
for other hosts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MESSAGES = DOCS / "guides" / "errors.md"  # the table of messages and what to do


def documents() -> list[Path]:
    """The pages whose code blocks are checked: README and the site's pages for users
    (the design and reliability notes show code to read, not to run)."""
    return [README, DOCS / "index.md", DOCS / "quickstart.md", *sorted((DOCS / "guides").glob("*.md"))]

CHECKED = ("bash", "python", "toml")
_MARKER = re.compile(r"^<!-- check: (.*?) -->$")
_PRINTS = re.compile(r'^runs until stopped; prints "(.*)"$')

# Other hosts become loopback addresses (127.0.0.N is this host for any N); nothing
# is ever bound to all interfaces.
HOSTS = {"head-host": "127.0.0.1", "host-1": "127.0.0.1", "0.0.0.0": "127.0.0.1", "10.0.0.1": "127.0.0.1",
         "10.0.0.2": "127.0.0.2", "10.0.0.3": "127.0.0.3"}
# The documents' ports, by what they are: replaced by ports the test picked.
ADDRESSES = {"8000": "server", "8001": "relay", "9100": "metrics"}
# The documents' absolute paths: replaced by directories of the test's own.
PATHS = ("/var/lib/tensorshare", "/var/lib/ts", "/scratch/ts", "/etc/tensorshare/token")


@dataclass(frozen=True)
class Block:
    path: Path  # the document
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    check: str | None  # the marker's words, None without a marker

    @property
    def name(self) -> str:
        """How a test calls it: the document, language and line, with its first line of code."""
        first = next((line.strip() for line in self.text.splitlines() if line.strip()), "")
        return f"{self.path.relative_to(ROOT)}:{self.lang}:{self.line}:{first[:40]}"

    @property
    def needs(self) -> str | None:
        """What it needs that a test cannot have (None: it is run)."""
        if self.check and self.check.startswith("needs "):
            return self.check[len("needs "):]
        return None

    @property
    def prints(self) -> str | None:
        """For a block that serves until stopped, what it prints once it serves."""
        match = _PRINTS.match(self.check or "")
        return match.group(1) if match else None

    def lines(self) -> list[str]:
        """Its shell commands: one per line, comments and blank lines left out."""
        out = []
        for line in self.text.splitlines():
            line = strip_comment(line).strip()
            if line:
                out.append(line)
        return out


def all_blocks() -> list[Block]:
    """Every block to check of every document (:func:`documents`)."""
    return [block for path in documents() for block in blocks(path)]


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of the document ``path`` that is code to check (see :data:`CHECKED`)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if lang in CHECKED:
            marker = _MARKER.match(lines[start - 1]) if start else None
            out.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return out


def messages(path: Path = MESSAGES) -> list[tuple[str, str]]:
    """The rows of the table of messages: ``(message, what to do)``."""
    lines = path.read_text().splitlines()
    start = lines.index("<!-- check: messages -->")
    rows = []
    for line in lines[start + 3:]:
        if not line.startswith("| "):
            break
        message, advice = re.match(r"^\| `(.*?)` \| (.*) \|$", line).groups()
        rows.append((message, advice))
    return rows


def message_pattern(message: str) -> re.Pattern:
    """A documented message as a pattern: its ``...`` match anything, a loopback address
    any port on it, the rest itself."""
    parts = [re.escape(part).replace(re.escape("127.0.0.1:"), "@") for part in message.split("...")]
    return re.compile(".*?".join(re.sub(r"@\d+", r"127\\.0\\.0\\.1:\\d+", p).replace("@", re.escape("127.0.0.1:"))
                                 for p in parts), re.DOTALL)


def strip_comment(line: str) -> str:
    """A shell line without its ``#`` comment (a ``#`` inside quotes stays)."""
    quote = None
    for i, c in enumerate(line):
        if c in "'\"" and quote in (None, c):
            quote = None if quote == c else c
        elif c == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def localize(text: str, ports: dict[str, int], paths: dict[str, str]) -> str:
    """``text`` with the documents' hosts, ports and paths replaced by the test's."""
    for readme, host in HOSTS.items():
        text = text.replace(readme, host)
    for readme, what in ADDRESSES.items():
        if what in ports:
            text = re.sub(rf"(?<![\d.]){readme}(?!\d)", str(ports[what]), text)
    for readme in PATHS:
        text = text.replace(readme, paths[readme])
    return text


def expect_raises(code: str) -> str:
    """``stmt  # raises NoSuchBinError ...`` becomes a check that ``stmt`` raises it."""
    out = []
    for line in code.splitlines():
        match = re.match(r"^(\s*)(\S.*?)\s*# raises (\w+)", line)
        if not match:
            out.append(line)
            continue
        indent, statement, error = match.groups()
        out += [f"{indent}try:", f"{indent}    {statement}", f"{indent}except tensorshare.errors.{error}:",
                f"{indent}    pass", f"{indent}else:",
                f"{indent}    raise AssertionError({statement!r} + ' did not raise {error}')"]
    return "\n".join(out) + "\n"
