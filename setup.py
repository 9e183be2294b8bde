"""Packaging: which packages the distribution holds (the rest is declared in setup.cfg).

Found, not listed: every package under ``tensorshare/``, and every package under
``server/`` as ``tensorshare_server.*``, so a new subpackage cannot be left out of
the wheel (tests/test_install.py checks the built wheel against the source tree).

One C extension, optional: the tables' hot loops (``server/bins/tables/_loops.c``:
the prioritized sampler's sum-tree search and refresh, and the like).  Where no C
compiler is at hand the build says so and goes on, and the server uses the same loops
in numpy (slower at 10^7 rows and up; the tables' behaviour is the same).
"""

import sys

from setuptools import Extension, find_packages, setup

setup(packages=[*find_packages(include=["tensorshare", "tensorshare.*"]),
                "tensorshare_server", *(f"tensorshare_server.{name}" for name in find_packages("server"))],
      ext_modules=[Extension("tensorshare_server.bins.tables._loops", ["server/bins/tables/_loops.c"],
                             extra_compile_args=["-O2"], optional=True,
                             libraries=["dl"] if sys.platform.startswith("linux") else [])])
