"""Connections a real peer opens to the api-server's gRPC listener, each one the listener refuses
for a reason of its own (api-server/src/listener.rs; counted in rides.grpc.connections.refused):

  not-http2   one connection that speaks HTTP/1.1 instead of the HTTP/2 preface (handshake_failed)
  silent      one connection that sends nothing, held until the server closes it after
              GRPC_PREFACE_TIMEOUT_MS (preface_timeout)
  fill        from --source: HTTP/2 connections (preface and SETTINGS sent, the server's SETTINGS
              read back) opened until the server closes a new one at once (the per-address cap,
              GRPC_MAX_CONNECTIONS_PER_IP: max_connections_per_ip), then --refused more closed at
              once, then all of them closed
  refused     from --source: --refused connections, each expected to be closed at once (a peer
              shut out for its refused calls: shut_out)

Prints what it saw on one line; exits 1 if the server did not answer as expected. Only the
standard library; run by deploy/monitoring/live-check.sh inside its charts window.

Usage: python3 peer.py MODE --target 127.0.0.1:19051 [--source 127.0.0.2] [--refused 3]
"""

import argparse
import socket
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# Far more than any per-address cap this is run against (the default is 256).
MAX_FILL = 2000


def connect(target: tuple[str, int], source: str | None) -> socket.socket:
    return socket.create_connection(target, timeout=10,
                                    source_address=(source, 0) if source else None)


def closed_at_once(target: tuple[str, int], source: str | None) -> bool:
    """A new connection that the server closes without a byte, within a second."""
    with connect(target, source) as sock:
        sock.settimeout(1)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def until_closed(sock: socket.socket, limit: float) -> float:
    """Reads until the server closes the connection; the seconds it took."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["not-http2", "silent", "fill", "refused"])
    parser.add_argument("--target", required=True, help="HOST:PORT of the gRPC listener")
    parser.add_argument("--source", help="the local address to connect from")
    parser.add_argument("--refused", type=int, default=3)
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    target = (host, int(port))

    if args.mode == "not-http2":
        with connect(target, args.source) as sock:
            # Longer than the 24-byte preface, so the server reads a whole one and refuses it at
            # once (a shorter request would wait for the preface timeout).
            sock.sendall(b"GET / HTTP/1.1\r\nHost: live-check\r\nConnection: close\r\n\r\n")
            until_closed(sock, 30)
        print("peer: a connection that is not HTTP/2, closed by the server", file=sys.stderr)
        return 0

    if args.mode == "silent":
        with connect(target, args.source) as sock:
            took = until_closed(sock, 60)
        print(f"peer: a silent connection, closed by the server after {took:.1f} s",
              file=sys.stderr)
        return 0

    if args.mode == "refused":
        refused = sum(closed_at_once(target, args.source) for _ in range(args.refused))
        print(f"peer: {refused} of {args.refused} connections from {args.source} closed at once",
              file=sys.stderr)
        return 0 if refused == args.refused else 1

    held: list[socket.socket] = []
    try:
        while len(held) < MAX_FILL:
            sock = connect(target, args.source)
            try:
                sock.sendall(PREFACE + SETTINGS)
                # The server's SETTINGS: the connection was admitted and reached HTTP/2.
                admitted = sock.recv(9) != b""
            except (ConnectionResetError, BrokenPipeError):
                admitted = False
            if not admitted:
                sock.close()
                break
            held.append(sock)
        else:
            print(f"peer: {MAX_FILL} connections from {args.source} and none refused",
                  file=sys.stderr)
            return 1
        refused = 1 + sum(closed_at_once(target, args.source) for _ in range(args.refused - 1))
    finally:
        for sock in held:
            sock.close()
    print(f"peer: {len(held)} HTTP/2 connections from {args.source} held, then {refused} of "
          f"{args.refused} more closed at once", file=sys.stderr)
    return 0 if refused == args.refused else 1


if __name__ == "__main__":
    sys.exit(main())
