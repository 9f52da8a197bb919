"""Transport: rendezvous (address exchange), the ZeroMQ peer mesh, same-host shared memory, and
the one-sided array store (:mod:`sdp.transport.store`)."""
