"""The bins: the pure bin store, the storage interface with its disk tiers (spill
area, data directory, shared-memory area), and the threads that do the file work."""
