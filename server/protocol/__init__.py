"""The server side of the protocol, sans-IO: one connection's session (a state
machine), the verb handlers, listeners and the same-host zero-copy policy."""
