"""Seeing inside a running server: counters, the metrics and status endpoints, logging, config files.

Nothing here is on the request path but :mod:`.counters`, whose updates are plain
integer increments the session makes; everything else reads state the server
already keeps, when someone asks (a Prometheus scrape, the status page).
"""
