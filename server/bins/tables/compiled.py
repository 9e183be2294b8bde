"""The tables' hot loops compiled in C (``_loops.c``), or None where they were not built.

setup.py builds them where a C compiler is at hand; without one the install says so and
every caller takes its numpy path, which stays the reference (the tests hold the two to
the same answers).  Callers read ``compiled.loops`` at each call, so a test can switch
the whole engine to numpy's paths by setting it to None.
"""

try:
    from . import _loops as loops
except ImportError:  # built without a C compiler: numpy does it all
    loops = None
