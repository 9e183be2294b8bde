"""Packaging: which packages the distribution holds (the rest is declared in setup.cfg).

Found, not listed: every package under ``tensorshare/``, and every package under
``server/`` as ``tensorshare_server.*``, so a new subpackage cannot be left out of
the wheel (tests/test_install.py checks the built wheel against the source tree).
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["tensorshare", "tensorshare.*"]),
                "tensorshare_server", *(f"tensorshare_server.{name}" for name in find_packages("server"))])
