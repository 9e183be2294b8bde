"""What both ends of the protocol share, without torch: the declared messages
(:mod:`.messages`), authentication, TLS settings, pacing helpers, and telling
who answered a connection (:mod:`.peers`)."""
