"""The port probe every runtime uses before a launch."""

from __future__ import annotations

import socket

from workers.runtimes.base import busy_ports


def test_busy_ports_finds_a_listening_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        assert busy_ports("127.0.0.1", [taken, free]) == [taken]
