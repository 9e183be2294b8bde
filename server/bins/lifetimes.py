"""When stored files go: an item's once nothing refers to it, shared files once no reply does.

Files of items that left the store are deleted once nothing refers to the item any
more (a GET reply in flight may still put it back), through a finalizer.  Files in
shared memory are deleted once nothing refers to their
:class:`~.spill.ItemFiles` (an item, or a reply whose client has not mapped them
yet).  The deletions run as disk jobs; after :meth:`FileLifetimes.close` (the server
stops and removes its areas whole) finalizers that run late leave the files alone.
"""

from __future__ import annotations

import weakref

from .spill import ItemFiles, remove, remove_dir


class FileLifetimes:
    """Finalizers that delete stored files through ``jobs`` (a :class:`~.jobs.Jobs`)."""

    def __init__(self, jobs):
        self.jobs = jobs
        self._open = [True]  # shared with the finalizers, which must not keep this object

    @property
    def open(self) -> bool:
        return self._open[0]

    def watch(self, item) -> None:
        """Delete ``item``'s files once it is gone from the store and from every reply."""
        weakref.finalize(item, _collect, self.jobs, item.files, self._open).atexit = False

    def watch_shared(self, files: ItemFiles) -> None:
        """Delete files in shared memory once no item and no reply refers to them."""
        weakref.finalize(files, _discard, self.jobs, files.path, self._open).atexit = False

    def close(self) -> None:
        self._open[0] = False


def _collect(jobs, files: ItemFiles, open_: list) -> None:
    if files.dropped and open_[0]:
        jobs.run_threadsafe(files.lane, remove, (files,))


def _discard(jobs, path: str, open_: list) -> None:
    if open_[0]:
        jobs.run_threadsafe(None, remove_dir, (path,))
