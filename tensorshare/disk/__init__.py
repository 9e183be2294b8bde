"""The layout of stored items on disk and in shared memory, which the server writes
and clients map (:mod:`.layout`), and the rules for trusting a shared directory
(:mod:`.areas`)."""
