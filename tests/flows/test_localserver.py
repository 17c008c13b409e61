"""The local server's port check (flows/localserver.py)."""

from __future__ import annotations

import socket

from gridsolve.flows.localserver import port_in_use


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free() -> None:
    """A server that closed its connections first leaves them in TIME-WAIT for ~60 s;
    a restart on that port binds with SO_REUSEADDR (as uvicorn does), so it is free."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its side goes to TIME-WAIT
    client.close()
    listener.close()
    assert not port_in_use("127.0.0.1", port)


def test_a_listening_port_is_in_use() -> None:
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert port_in_use("127.0.0.1", busy.getsockname()[1])
