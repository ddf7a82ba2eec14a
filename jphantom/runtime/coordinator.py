"""Checks of a jax coordinator address that jax itself turns into crashes, as Python errors.

jax 0.10 segfaults on a non-numeric port and aborts (SIGABRT) on port 99999, on a taken port, and
when something other than its coordinator listens at the address (ignoring the timeout). These
checks run before jax sees the address: :func:`split_address` parses it, :func:`check_port_free` is
process 0's bind test, :func:`probe_coordinator` the other processes' test that a gRPC server (so
HTTP/2, RFC 9113) answers there. Each raises ConfigError (a bad value) or RuntimeError (nothing
answered in time) naming the address.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import time

from jphantom.errors import ConfigError

# HTTP/2 client connection preface, then an empty SETTINGS frame (type 0x4; RFC 9113 3.4, 6.5).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# A gRPC call of a method no service has (RFC 9113 6.2 HEADERS, RFC 7541 literals without
# indexing, no Huffman): a gRPC server answers HTTP status 200 (grpc-status UNIMPLEMENTED); an
# HTTP/2 server or proxy that is no gRPC server answers another status (a sandbox's proxy: 404).
_CALL = (b"\x83\x86"                                      # :method POST, :scheme http
         + b"\x04\x33/xla.coordination.CoordinationService/JphantomProbe"          # :path
         + b"\x0f\x10\x10application/grpc"                 # content-type
         + b"\x00\x02te\x08trailers")
_CALL_FRAME = len(_CALL).to_bytes(3, "big") + b"\x01\x05\x00\x00\x00\x01" + _CALL  # stream 1
_STATUS = {0x88: 200, 0x89: 204, 0x8A: 206, 0x8B: 304, 0x8C: 400, 0x8D: 404, 0x8E: 500}
_CALL_WAIT = 5.0  # seconds for the call's answer once SETTINGS came (none: as before, accepted)
_BACKLOG = 64  # process 0's self-reach listener: peers probing at once never crowd out its client


def split_address(address, name: str = "coordinator_address") -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) -> ``(host, port)``; ConfigError naming ``name``."""
    fix = f"Fix: write {name} as host:port with a port in 1..65535, e.g. '10.0.0.1:12355'"
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"{name}={address!r} is not host:port. {fix}")
    host, _, port = address.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{name}={address!r} has no usable host. {fix}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name}={address!r}: port {port!r} is not an integer in 1..65535. {fix}")
    return host, int(port)


def check_port_free(port: int) -> None:
    """Process 0's check that jax's coordinator can bind ``[::]:port``; ConfigError if not."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                return
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES) or family == socket.AF_INET:
                raise ConfigError(
                    f"coordinator_address: process 0 cannot start the coordinator on port {port} "
                    f"({err.strerror}). Fix: pick a free port >= 1024 for every process") from None


def check_reaches_self(address: str, timeout: float) -> None:
    """Process 0's check that ``address`` reaches this host: a listener on its port, then a
    connection to ``address`` within ``timeout`` s (jax's own client, which connects to it,
    would abort the process after ~20 s instead). ConfigError naming the address if not."""
    host, port = split_address(address)
    listener = None
    for family, any_host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((any_host, port))
            listener.listen(_BACKLOG)  # peers' probes queued beside the check's own client
            break
        except OSError:
            listener.close()
            listener = None
    if listener is None:
        return  # check_port_free names the port's problem
    token = os.urandom(16)
    try:
        with socket.create_connection((host, port), timeout=timeout) as client:
            client.sendall(token)
            _accept_token(listener, token, timeout)
    except OSError as err:
        why = "nothing of this host answered" if isinstance(err, TimeoutError) else (
            f"{type(err).__name__}: {err}")
        raise ConfigError(
            f"coordinator_address {address}: process 0 runs the coordinator, but {host} does not "
            f"reach this host ({why}). Fix: give every process an address of process 0's own "
            "host (its name or IP), or start process 0 on that host") from None
    finally:
        listener.close()


def _accept_token(listener: socket.socket, token: bytes, timeout: float) -> None:
    """Accept connections on ``listener`` until one carries ``token`` (this process's own client,
    which sent it before this runs) within ``timeout`` s. Other processes' connections (peers
    already probing for the coordinator, :func:`probe_coordinator`, which retry) are read side by
    side and closed: a peer that connected but is slow to write (a loaded machine) holds up
    nothing. No token in time means another listener took the client's connection (a proxy):
    OSError."""
    import selectors

    deadline = time.monotonic() + timeout
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                if key.data is None:  # a connection to accept
                    try:
                        accepted, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    accepted.setblocking(False)
                    selector.register(accepted, selectors.EVENT_READ, b"")
                    continue
                try:
                    chunk = key.fileobj.recv(len(token) - len(key.data))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                data = key.data + chunk
                if data == token:
                    return
                if chunk and token.startswith(data):  # part of it so far
                    selector.modify(key.fileobj, selectors.EVENT_READ, data)
                    continue
                selector.unregister(key.fileobj)  # a peer's probe, or closed early
                key.fileobj.close()
    finally:
        for key in list(selector.get_map().values()):
            if key.data is not None:
                key.fileobj.close()
        selector.close()
        listener.setblocking(True)
    raise OSError("another listener answered")


def probe_coordinator(address: str, timeout: float) -> None:
    """Process != 0's check that a jax coordinator answers at ``address`` within ``timeout`` s.

    Retries the TCP connect until the deadline (process 0 may start later), then sends the HTTP/2
    preface and expects the server's SETTINGS frame, as every gRPC server sends, then HTTP
    status 200 for a gRPC call of a method no service has (:data:`_CALL`; another HTTP/2 server,
    such as a proxy answering for an unreachable host, gives 404; no answer within
    :data:`_CALL_WAIT` s is accepted, as SETTINGS alone once was). Raises ConfigError
    when something else answers, RuntimeError when nothing answers in time; both name ``address``.
    """
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    last = "no connection attempt finished"
    while (left := deadline - time.monotonic()) > 0:
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as err:  # refused, unreachable, name not (yet) resolvable
            last = f"{type(err).__name__}: {err}"
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        if _self_connected(sock):  # no listener yet; the kernel gave the port to our own probe
            sock.close()
            last = "no listener yet (a connection to itself, closed)"
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        with sock:
            header = _first_frame_header(sock, deadline)
            length, kind, stream = int.from_bytes(header[:3], "big"), header[3:4], header[5:]
            settings = len(header) == 9 and kind == b"\x04" and length % 6 == 0 and not any(stream)
            status = _call_status(sock, length, min(deadline, time.monotonic() + _CALL_WAIT)) \
                if settings else None
        if settings and status in (None, 200):
            return
        if settings:
            raise ConfigError(
                f"coordinator_address {address}: an HTTP/2 server answers there but no jax "
                f"coordinator (a gRPC call got HTTP status {status}, where gRPC answers 200; "
                "a proxy may be answering for a host this machine cannot reach). Fix: give "
                "the host:port of process 0, reachable from here without a proxy")
        if len(header) == 9:
            raise ConfigError(
                f"coordinator_address {address}: what listens there is not a jax coordinator (it "
                f"answered {header!r}, not an HTTP/2 SETTINGS frame). Fix: give the host:port of "
                "process 0, on a port that no other service uses")
        last = "something accepted the connection but gave no HTTP/2 (gRPC) answer"
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise RuntimeError(
        f"coordinator_address {address}: no jax coordinator answered within {timeout:g} s "
        f"({last}). Check that process 0 runs with the same address, that the host resolves and "
        "the port is reachable from here, or raise initialization_timeout")


def _self_connected(sock: socket.socket) -> bool:
    """Whether ``sock`` is connected to itself: a TCP connect to a local port nothing listens on
    can draw that same port as its own (simultaneous open), and would then read its own preface
    back and take it for a foreign service, and hold the port process 0 is about to bind."""
    try:
        return sock.getsockname()[:2] == sock.getpeername()[:2]
    except OSError:
        return False


def _first_frame_header(sock: socket.socket, deadline: float) -> bytes:
    """Send the client preface and the probe's gRPC call; the server's first 9 bytes (fewer on
    silence, close or reset)."""
    header = b""
    try:
        sock.sendall(_PREFACE + _CALL_FRAME)
        while len(header) < 9 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(9 - len(header))
            if not chunk:
                break
            header += chunk
    except OSError:
        pass
    return header


def _call_status(sock: socket.socket, skip: int, deadline: float) -> int | str | None:
    """The HTTP status of the answer to :data:`_CALL_FRAME` (the first HEADERS frame of stream
    1), after ``skip`` payload bytes of the frame already read; None when none came in time."""
    buffer = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                return None
            buffer += chunk
            while len(buffer) >= skip + 9:  # past the frames read: the next frame's header
                buffer, skip = buffer[skip:], 0
                length, kind, stream = (int.from_bytes(buffer[:3], "big"), buffer[3],
                                        int.from_bytes(buffer[5:9], "big"))
                if kind == 0x1 and stream == 1:  # HEADERS: its first field is :status
                    if len(buffer) < 9 + min(length, 16):
                        break  # read on
                    return _status_of(buffer[9:9 + length])
                buffer, skip = buffer[9:], length
    except OSError:
        pass
    return None


def _status_of(block: bytes) -> int | str:
    """The ``:status`` an HPACK block starts with (RFC 7541 6.1 indexed, or 6.2 literal with the
    static name or a literal ``:status`` name, its value not Huffman-coded)."""
    if block[:1] and block[0] in _STATUS:
        return _STATUS[block[0]]
    found = re.match(rb"(?:[\x08-\x0e\x18-\x1e\x48-\x4e]|[\x00\x10\x40]\x07:status)\x03(\d{3})",
                     block)
    return int(found.group(1)) if found else f"other than 200 (HPACK {block[:8]!r})"
