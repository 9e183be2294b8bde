"""A server of several processes that share nothing (``tensorshare-server --workers N``).

Each worker is a whole one-process server that serves the bins and tables whose
names hash to it (``tensorshare/protocol/placement.py``); clients route each
request to its owner (PROTOCOL.md §14).  :mod:`.supervisor` is the parent
(sockets, workers, restarts, the data directory's lock), :mod:`.child` a worker's
start, :mod:`.ownership` a worker's refusal of other workers' bins, :mod:`.layout`
the data directory's worker directories, :mod:`.ops` the whole server's metrics
and status page.
"""
