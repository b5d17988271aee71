"""A TCP proxy in front of one HTTP/1.1 server (an etcd member's client port) that loses answers:
the request is passed on, the server answers, and the client's connection is closed instead of
the answer handed over, so the server acted and the client never heard (python3 stdlib only).

    with LossyProxy("127.0.0.1", etcd.client_ports[0], lose=is_ticket) as p:
        ddprun ... --rdzv-endpoint p.endpoint,<member 1>,<member 2> ...
        assert p.lost

lose(path, body) -> bool picks the requests (body: the request's bytes); the first one picked
loses its answer, and so do the next times - 1 sends of the very same request (a client's
retries). Every request passes through unchanged (bytes are forwarded as they
come; requests are only parsed as they go by, to know where each ends), answers of other
requests too, streamed ones (watches) included. Plain HTTP/1.1 without pipelining, as libcurl
speaks it: an answer on a connection belongs to the last request sent on it.
"""
import socket
import threading


class LossyProxy:
    def __init__(self, host, port, lose, times=1):
        self.upstream = (host, port)
        self.should_lose = lose
        self.times = times
        self.seen = []  # (path, body) of every request lose() picked, lost or not
        self.lost = []  # (path, body) of the requests whose answers were lost
        self._lock = threading.Lock()
        self._conns = set()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"{host}:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            _close(s)

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns.update((client, server))
            conn = _Conn(self, client, server)
            threading.Thread(target=conn.requests, daemon=True).start()
            threading.Thread(target=conn.answers, daemon=True).start()

    def _pick(self, path, body):
        """Whether this request's answer is to be lost."""
        if not self.should_lose(path, body):
            return False
        with self._lock:
            self.seen.append((path, body))
            if len(self.lost) >= self.times or self.lost and self.lost[0] != (path, body):
                return False
            self.lost.append((path, body))
            return True


class _Conn:
    """One client connection and its own connection to the server."""

    def __init__(self, proxy, client, server):
        self.proxy, self.client, self.server = proxy, client, server
        self.losing = threading.Event()  # set once a request to lose went out whole

    def requests(self):
        """Client -> server: forward every byte, parse requests to find the ones to lose."""
        buf = b""
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                buf += data
                while True:
                    request, buf = _one_request(buf)
                    if request is None:
                        break
                    if self.proxy._pick(*request):  # before its end goes out: no answer yet
                        self.losing.set()
                    self.server.sendall(data[:len(data) - len(buf)])
                    data = data[len(data) - len(buf):]
                self.server.sendall(data)
        except OSError:
            pass
        _close(self.server)

    def answers(self):
        """Server -> client: forward, except the answer to a request to lose: read it whole from
        the server (it has acted by then), then close the client's connection."""
        buf = b""
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                if not self.losing.is_set():
                    self.client.sendall(data)
                    continue
                buf += data
                if _one_answer(buf):
                    break
        except OSError:
            pass
        _close(self.client)
        _close(self.server)


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _headers(buf):
    """(first line, {name: value}, body offset) of the head at buf's start, or None while it is
    incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return lines[0], fields, end + 4


def _one_request(buf):
    """((path, body), rest) of the whole request at buf's start, or (None, buf)."""
    head = _headers(buf)
    if head is None:
        return None, buf
    first, fields, start = head
    if "chunked" in fields.get("transfer-encoding", ""):
        raise OSError("chunked requests are not parsed")  # libcurl sends Content-Length
    end = start + int(fields.get("content-length", "0"))
    if len(buf) < end:
        return None, buf
    parts = first.split(" ")
    return (parts[1] if len(parts) > 1 else "", buf[start:end]), buf[end:]


def _one_answer(buf):
    """Whether buf holds a whole final answer (a 100 Continue before it is skipped)."""
    while True:
        head = _headers(buf)
        if head is None:
            return False
        first, fields, start = head
        if first.split(" ")[1:2] != ["100"]:
            break
        buf = buf[start:]
    if "chunked" in fields.get("transfer-encoding", ""):
        return buf.endswith(b"0\r\n\r\n")
    return len(buf) >= start + int(fields.get("content-length", "0"))
