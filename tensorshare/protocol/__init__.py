"""What both ends of the protocol share, without torch: the declared messages
(:mod:`.messages`), authentication, TLS settings and pacing helpers."""
