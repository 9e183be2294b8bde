"""The distribution as a user installs it: the wheel built from this source, and
README's install lines, each into a fresh virtual environment, then README's
first example run there against the installed ``tensorshare-server``.

Offline and quick: nothing is downloaded.  The fresh environment sees this test
environment's packages (torch, Twisted, the extras' requirements) through a
``.pth`` line naming a view of its site-packages that leaves this project out
(its editable install, its metadata), so pip resolves the extras' requirements
against them for real, and every module of tensorshare, its metadata and its
commands come from what the wheel installed (each test checks where they come
from).  The ``torchrl`` and ``ray`` extras need packages this environment holds
only in part (ray without ``ray[default]``'s, torchrl beside a newer tensordict):
their requirements are checked in the wheel's metadata, and their modules
imported from the installed wheel.
"""

from __future__ import annotations

import configparser
import email
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import tensorshare
from docblocks import all_blocks, expect_raises

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE", "tensorshare", "server")
NAME = "torch-tensorshare"
# Each extra README names, the packages it must bring, and a module that needs them.
EXTRAS = {"tls": ({"pyopenssl", "service-identity"}, "tensorshare_server.net.tls"),
          "metrics": ({"prometheus-client"}, "tensorshare_server.ops.prom"),
          "cli": ({"rich"}, "tensorshare.cli"),
          "torchrl": ({"torchrl", "gymnasium"}, "tensorshare.torchrl"),
          "ray": ({"ray"}, "tensorshare.ray")}
RESOLVED_OFFLINE = "tls,metrics,cli"  # extras whose requirements this environment holds whole
PIP_TIMEOUT = 180


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of what a clone holds for building (a build writes into its tree)."""
    root = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, root / name)
    return root


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "-w", str(out), str(source)])
    [built] = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory) -> Path:
    """This environment's site-packages without this project: links to everything else."""
    view = tmp_path_factory.mktemp("dependencies")
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("torch_tensorshare", "tensorshare", "__editable__")) or name.endswith(".pth"):
            continue
        (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def bytecode(tmp_path_factory) -> Path:
    """Where the fresh environments' processes cache bytecode: with this test's files.
    Under the suite's cache (``PYTHONPYCACHEPREFIX``, keyed by source path) each run
    left about 80 MB there for the temporary paths of the view and the environments."""
    return tmp_path_factory.mktemp("bytecode")


def fresh_venv(path: Path, dependencies: Path, bytecode: Path) -> Path:
    """A new virtual environment that sees ``dependencies``; returns its python."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               bytecode=bytecode).stdout.strip()
    Path(site, "dependencies.pth").write_text(f"{dependencies}\n")
    return python


def pip_install(python: Path, bytecode: Path, *args: str, cwd: Path | None = None) -> None:
    """``pip install ARGS`` into ``python``'s environment, offline (the build runs
    there too: its bytecode goes to ``bytecode``; the installed files are compiled
    when imported)."""
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-build-isolation",
         "--no-compile", "--quiet", "--disable-pip-version-check", *args], cwd=cwd, bytecode=bytecode)


def environment(bytecode: Path | None = None) -> dict:
    """The processes' environment: this one's, less what would point them at this
    checkout; ``bytecode``: a fresh environment's process, caching there (:func:`bytecode`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TENSORSHARE_TOKEN")}
    if bytecode is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    return env


def run(cmd: list[str], cwd: Path | None = None, timeout: float = PIP_TIMEOUT, bytecode: Path | None = None,
        **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environment(bytecode),
                         **kw)
    assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-3000:])
    return out


ORIGIN = """
import importlib, importlib.metadata as md, json, sys
dist = md.distribution(sys.argv[1])
modules = {name: importlib.import_module(name).__file__ for name in sys.argv[2:]}
print(json.dumps({"dist": str(dist.locate_file("")), "files": len(dist.files or []), "modules": modules,
                  "scripts": sorted(ep.name for ep in dist.entry_points if ep.group == "console_scripts"),
                  "copies": [str(d.locate_file("")) for d in md.distributions() if d.metadata["Name"] == sys.argv[1]]}))
"""


def origin(python: Path, bytecode: Path, *modules: str) -> dict:
    """Where ``python`` finds this project's distribution and ``modules``."""
    return json.loads(run([str(python), "-c", ORIGIN, NAME, *modules], cwd=python.parent, bytecode=bytecode).stdout)


# -- the wheel


def test_the_wheel_holds_every_module_and_says_what_it_needs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sources = {f"{top}/{path.relative_to(ROOT / folder).as_posix()}"
               for folder, top in (("tensorshare", "tensorshare"), ("server", "tensorshare_server"))
               for path in (ROOT / folder).rglob("*.py")}
    assert sources - set(names) == set(), "modules missing from the wheel"
    assert "tensorshare/py.typed" in names  # type checkers read the installed package's annotations
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/"))]
    [meta_name] = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_string(zipfile.ZipFile(wheel).read(meta_name).decode())
    assert meta["Name"] == NAME and meta["Version"] == tensorshare.__version__
    assert meta["Home-page"] and {url.split(",")[0] for url in meta.get_all("Project-URL")} >= {"Documentation",
                                                                                               "Source", "Changelog"}
    needs: dict[str, set] = {}
    for requirement in meta.get_all("Requires-Dist"):
        match = re.match(r'^([A-Za-z0-9_.\-]+).*?(?:extra == "(\w+)")?$', requirement)
        needs.setdefault(match.group(2), set()).add(normalize(match.group(1)))
    assert {"twisted", "torch", "msgpack", "numpy"} <= needs[None]
    for extra, (packages, _) in EXTRAS.items():
        assert packages <= needs.get(extra, set()), (extra, needs.get(extra))
    entry_points = configparser.ConfigParser()
    [ep_name] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entry_points.read_string(zipfile.ZipFile(wheel).read(ep_name).decode())
    assert dict(entry_points["console_scripts"]) == {"tensorshare-server": "tensorshare_server.cli:main",
                                                     "tensorshare": "tensorshare.cli:main"}


def test_readme_names_the_distribution_and_its_extras():
    """README's install lines install this project: its name, extras it has."""
    lines = [line for block in all_blocks() if block.lang == "bash" for line in block.lines()
             if line.startswith("pip install")]
    assert lines
    for line in lines:
        for spec in shlex.split(line)[2:]:
            if spec.startswith("-"):
                continue
            match = re.match(r"^([\w.\-]*)\[([\w,]+)\]$", spec)
            assert match, f"README: pip install {spec}: neither this checkout nor {NAME} with extras"
            assert match.group(1) in (".", NAME), spec
            assert set(match.group(2).split(",")) <= set(EXTRAS), spec


def test_the_wheel_installs_with_its_extras_and_runs_the_first_example(wheel, dependencies, bytecode, tmp_path):
    python = fresh_venv(tmp_path / "venv", dependencies, bytecode)
    pip_install(python, bytecode, f"{wheel}[{RESOLVED_OFFLINE}]")  # the requirements resolved, not skipped
    modules = ("tensorshare", "tensorshare_server", "tensorshare.rl", "tensorshare_server.relay",
               *(module for _, module in EXTRAS.values()))
    found = origin(python, bytecode, *modules)
    site = str(tmp_path / "venv")
    assert found["dist"].startswith(site) and found["copies"] == [found["dist"]], found
    assert all(path.startswith(site) for path in found["modules"].values()), found["modules"]
    assert found["scripts"] == ["tensorshare", "tensorshare-server"]
    server = subprocess.Popen([str(python.parent / "tensorshare-server"), "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=environment(bytecode))
    try:
        port = re.search(r"listening on [\d.]+:(\d+)", server.stdout.readline()).group(1)
        first = next(b for b in all_blocks() if b.lang == "python" and "tensorshare.Client(" in b.text)
        run([str(python), "-c", expect_raises(first.text.replace("8000", port))], cwd=tmp_path, timeout=120,
            bytecode=bytecode)
        listing = run([str(python.parent / "tensorshare"), "--json", "ls", "--port", port], cwd=tmp_path,
                      bytecode=bytecode)
        assert {"bin": "rollouts", "items": 0, "kind": "bin"} in json.loads(listing.stdout)
    finally:
        server.terminate()
        assert server.wait(30) == 0
        server.stdout.close()
        server.stderr.close()


def test_readme_install_lines_install_this_checkout(source, dependencies, bytecode, tmp_path):
    """Each ``pip install`` line of README that installs from a clone, as written, at the
    clone's root, into an environment of its own."""
    lines = list(dict.fromkeys(line for block in all_blocks() if block.lang == "bash" and not block.needs
                               for line in block.lines() if line.startswith("pip install")))  # (once each)
    assert lines
    for i, line in enumerate(lines):
        args = shlex.split(line)[2:]
        python = fresh_venv(tmp_path / f"venv{i}", dependencies, bytecode)
        pip_install(python, bytecode, *args, cwd=source)
        found = origin(python, bytecode, "tensorshare", "tensorshare_server")
        where = str(source) if "-e" in args else str(tmp_path / f"venv{i}")
        assert all(path.startswith(where) for path in found["modules"].values()), (line, found)
        assert found["copies"] == [found["dist"]], (line, found)
