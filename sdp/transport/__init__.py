"""ZeroMQ transport: rendezvous (address exchange) and the peer mesh."""
