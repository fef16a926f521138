"""A local run's rendezvous is unreachable from other hosts: while `stagewise run` trains, every TCP
socket its ranks listen on is bound to a loopback address (the store, gloo's own sockets)."""
from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path

from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from tests.dist.plans import make_plan

_LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp{,6} local address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    swapped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(swapped)


def _listening() -> dict[int, str]:
    """inode -> bound address of every listening TCP socket of this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == _LISTEN:
                addr, port = cols[1].split(":")
                out[int(cols[9])] = f"{_address(addr)}:{int(port, 16)}"
    return out


def _children() -> list[int]:
    """This process's child processes (the launcher's ranks)."""
    me, kids = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                kids.append(int(entry.name))
    return kids


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # the process ended, or a descriptor closed, while we looked
        pass
    return inodes


def _ranks_listening() -> set[str]:
    table = _listening()
    return {table[i] for pid in _children() for i in _socket_inodes(pid) if i in table}


def _is_loopback(bound: str) -> bool:
    addr = ipaddress.ip_address(bound.rsplit(":", 1)[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_a_local_run_listens_on_loopback_only(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    path = plan.save(tmp_path / "plan.json")
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_ranks_listening())
            done.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        launch(RunOptions(plan=str(path), steps=10), on_event=lambda e: seen.update(_ranks_listening()))
    finally:
        done.set()
        watcher.join()
    assert seen, "no listening socket of the ranks was seen during the run"
    assert all(_is_loopback(s) for s in seen), f"ranks listened beyond loopback: {sorted(seen)}"
