"""The drivers of the client engine (:mod:`tensorshare.protocol.engine`): how its bytes move.

:mod:`.twisted` drives it over Twisted (the AsyncClient and a relay's upstream,
torch-free); the blocking client's socket driver is ``tensorshare/_client/member.py``.
"""
