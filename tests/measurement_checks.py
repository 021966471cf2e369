"""Worker functions for tests/test_measurement.py (spawned processes import them by name)."""

import os
import socket

import torch.distributed as dist


def nic_window(interface_on_rank: dict) -> dict | None:
    """Each rank sets ZPP_NIC as told (or not at all), sends bytes over loopback, and stops the window."""
    from megatron_zpp.training.nic import NicWindow

    iface = interface_on_rank.get(dist.get_rank())
    if iface is None:
        os.environ.pop("ZPP_NIC", None)
    else:
        os.environ["ZPP_NIC"] = iface
    window = NicWindow()
    window.start()
    if window.reader:  # local rank 0 of a node: push 1 MB through loopback (counted by lo's tx)
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            client = socket.create_connection(server.getsockname())
            conn, _ = server.accept()
            client.sendall(bytes(1 << 20))
            got = 0
            while got < 1 << 20:
                got += len(conn.recv(1 << 20))
            client.close()
            conn.close()
    return window.stop()
