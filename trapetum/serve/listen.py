"""The listening socket, bound before anything is announced: a port in use is one line naming ``--port``,
not a "serving on ..." line followed by uvicorn's traceback."""
from __future__ import annotations

import errno
import socket

from ..errors import TrapetumError


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, with uvicorn's options (SO_REUSEADDR; IPv6 for a ':' host).
    TrapetumError naming --port / --host when the address is taken or cannot be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise TrapetumError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        sock.listen(2048)
    except OSError as e:
        sock.close()
        shown = f"[{host}]" if ":" in host else host
        if e.errno == errno.EADDRINUSE:
            raise TrapetumError(f"--port {port}: {shown}:{port} is already in use (another server is running "
                                "there?); choose another --port, or stop that server") from None
        if e.errno == errno.EACCES:
            raise TrapetumError(f"--port {port}: permission denied (ports below 1024 need root); choose a port "
                                "of 1024 or more") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise TrapetumError(f"--host {host}: not an address of this machine") from None
        raise TrapetumError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def raise_fd_limit() -> None:
    """Open files up to the hard limit: idle and slow connections are closed by the timeouts, and the soft
    default (often 1024) is the first thing many open connections run into."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass
