"""The Twisted adapter: the per-connection protocol and factory, the frame writer,
flow control, reactor polling, the receive pool, TLS, and the Twisted internals
all of that relies on."""
