"""The local run's cluster DNS: a name server for the pods, as CoreDNS is on a cluster.

:class:`ClusterDNS` answers, over UDP, from the names one ``PodNetwork`` knows and nothing else:
``A`` for every pod hostname and alias, ``PTR`` for every pod address, an empty answer for other
types of a known name (the pods have no IPv6), ``NXDOMAIN`` for other names. It never forwards:
pods resolve each other and nothing else. It is a daemon thread of the process that owns the
run, its socket made inside the run's DNS namespace (:mod:`.network` starts it).
"""

from __future__ import annotations

import ipaddress
import os
import selectors
import socket
import threading
from typing import Mapping

from dnslib import PTR, QTYPE, RCODE, RR, A, DNSError, DNSRecord, OPCODE


PORT = 53
TTL = 5  # CoreDNS's kubernetes plugin answers with a TTL of 5 s


def reverse_name(ip: str) -> str:
    """The ``in-addr.arpa`` name of an IPv4 address, without the final dot."""
    return ipaddress.IPv4Address(ip).reverse_pointer


class ClusterDNS:
    """Answers the pods' queries on ``sock`` (a bound UDP socket) until ``close``.

    Args:
        sock: the socket to serve; owned by the server from here on.
        name: the thread's name.
    """

    def __init__(self, sock: socket.socket, name: str = "cluster-dns"):
        self.sock = sock
        self.address = sock.getsockname()[0]
        self._forward: dict[str, str] = {}
        self._reverse: dict[str, str] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def set_records(self, forward: Mapping[str, str], reverse: Mapping[str, str]) -> None:
        """Serve exactly these names from now on: ``forward`` name -> IPv4 address, ``reverse``
        IPv4 address -> the name its ``PTR`` gives."""
        table = {_key(name): str(ipaddress.IPv4Address(ip)) for name, ip in forward.items()}
        back = {reverse_name(ip): name.rstrip(".") for ip, name in reverse.items()}
        self._forward, self._reverse = table, back  # each one assignment: a query sees old or new

    def answer(self, data: bytes) -> bytes | None:
        """The response to one query packet; None for a packet that is not a DNS message."""
        try:
            request = DNSRecord.parse(data)
        except (DNSError, ValueError, IndexError):
            return None
        if request.header.qr:  # a response: never answer one
            return None
        reply = request.reply(ra=0, aa=1)
        if request.header.opcode != OPCODE.QUERY or len(request.questions) != 1:
            reply.header.rcode = RCODE.NOTIMP if request.header.opcode != OPCODE.QUERY else RCODE.FORMERR
            return reply.pack()
        question = request.q
        name = _key(str(question.qname))
        forward, reverse = self._forward, self._reverse
        if name in forward:
            if question.qtype in (QTYPE.A, QTYPE.ANY):
                reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(forward[name]), ttl=TTL))
        elif name in reverse:
            if question.qtype in (QTYPE.PTR, QTYPE.ANY):
                reply.add_answer(RR(question.qname, QTYPE.PTR, rdata=PTR(reverse[name] + "."), ttl=TTL))
        else:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply.pack()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in sel.select():
                    if key.fileobj is not self.sock:
                        continue
                    try:
                        data, peer = self.sock.recvfrom(4096)
                    except OSError:
                        continue
                    response = self.answer(data)
                    if response is not None:
                        try:
                            self.sock.sendto(response, peer)
                        except OSError:
                            pass  # the asking pod went away or was cut off

    def close(self, timeout: float = 5.0) -> None:
        """Stop answering and close the socket; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _key(name: str) -> str:
    return name.rstrip(".").lower()
