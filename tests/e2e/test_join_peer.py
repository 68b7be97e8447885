"""`ditworker --join` against a fake daemon on TCP loopback: what a peer
that has not proved the shared secret sends cannot make the worker give up
for good, make it reserve memory or hold it past the handshake's deadline,
and what it prints of such a peer is escaped.

    test_join_peer.py CASE      runs one case (meson registers each as a test)
    test_join_peer.py --list    lists the cases

The fake speaks the join port's framing (proto/ipc_wire.h: a 4-byte
little-endian length, then a packed ditserve.ipc.Envelope), with the few
protobuf fields it needs written by hand.
"""

import hashlib
import hmac
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon import env_path, run_cases, wait_for  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


SECRET = b"7f3a9c0e5b2d48e1a6c4f0b9d3e7a215"
HANDSHAKE_S = 10  # DIT_JOIN_HANDSHAKE_S (worker/serve/join_auth.h)
# Envelope fields (proto/ditserve/ipc/ipc.proto).
CHALLENGE, JOIN, ACCEPT, REFUSED = 9, 10, 11, 12
# A reason that would clear the screen and forge a line of its own.
EVIL = b"wrong secret\x1b[2J\nditworker: joined"
EVIL_ESCAPED = b"wrong secret\\x1b[2J\\x0aditworker: joined"


def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([v & 0x7F | 0x80])
        v >>= 7
    return out + bytes([v])


def field(num, value):
    if isinstance(value, int):
        return varint(num << 3) + varint(value & (2**64 - 1))
    return varint(num << 3 | 2) + varint(len(value)) + value


def frame(body):
    return struct.pack("<I", len(body)) + body


def challenge(nonce, protocol=1):
    return frame(field(CHALLENGE, field(1, protocol) + field(2, nonce)))


def accept(mac):
    return frame(field(ACCEPT, field(1, mac)))


def refused(reason, permanent):
    return frame(field(REFUSED, field(1, reason) + field(2, int(permanent))))


def read_varint(buf, i):
    v, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def fields(buf):
    """A protobuf message's fields: {number: [value, ...]}, ints and bytes."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(buf, i)
        elif wire == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire}")
        out.setdefault(num, []).append(v)
    return out


def recv_exact(c, n):
    got = b""
    while len(got) < n:
        chunk = c.recv(n - len(got))
        if not chunk:
            raise AssertionError(f"the worker closed after {len(got)} of {n} bytes")
        got += chunk
    return got


def read_join(c):
    """The worker's JoinRequest: (its nonce, its MAC)."""
    n = struct.unpack("<I", recv_exact(c, 4))[0]
    assert n < 4096, n
    env = fields(recv_exact(c, n))
    assert JOIN in env, env
    req = fields(env[JOIN][0])
    return req[2][0], req[3][0]


def mac(role, first, second):
    return hmac.new(SECRET, role + b"\0" + first + second, hashlib.sha256).digest()


def until_closed(c, timeout_s=15):
    """Waits for the worker to close c; the seconds it took."""
    t0 = time.monotonic()
    c.settimeout(timeout_s)
    try:
        while c.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def hwm(pid):
    """The peak resident memory of process pid, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def hang_up(c):
    """Closes the connection at once (the worker tries again)."""
    return 0.0


class FakeDaemon:
    """A listener on loopback in place of ditd's join port. Connection i is
    handled by handlers[i] (the last one for all later connections); what a
    handler returns, or raises, is kept in results."""

    def __init__(self, *handlers):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.handlers = handlers
        self.conns = 0
        self.results = []
        self.worker_pid = None  # set once the worker runs
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            h = self.handlers[min(self.conns, len(self.handlers) - 1)]
            self.conns += 1
            with c:
                c.settimeout(30)
                try:
                    self.results.append(h(c))
                except Exception as e:  # noqa: BLE001 (the case reports it)
                    self.results.append(e)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Worker:
    """A `ditworker --join` at the fake, its stderr in a file."""

    def __init__(self, tmp, address, *extra):
        secret = os.path.join(tmp, "secret")
        with open(secret, "wb") as f:
            f.write(SECRET + b"\n")
        self.errf = open(os.path.join(tmp, "worker.err"), "wb+")
        self.proc = subprocess.Popen([env_path("DITWORKER"), "--join", address,
                                      "--secret-file", secret] + list(extra),
                                     stdout=subprocess.DEVNULL, stderr=self.errf)

    def stderr(self):
        with open(self.errf.name, "rb") as f:
            return f.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.errf.close()


def run(handlers, check):
    with tempfile.TemporaryDirectory() as tmp:
        fake = FakeDaemon(*handlers)
        w = Worker(tmp, fake.address)
        fake.worker_pid = w.proc.pid
        try:
            check(fake, w)
        except BaseException:
            print("----- worker stderr\n" + w.stderr().decode(errors="replace"), file=sys.stderr)
            print(f"----- fake daemon: {fake.conns} connections, {fake.results}", file=sys.stderr)
            raise
        finally:
            w.close()
            fake.close()


@case
def unproved_refusals():
    """A permanent refusal as the first message, a challenge whose nonce is
    not 32 bytes, one in another protocol, a proof that does not check
    followed by a permanent refusal: none of them comes from a peer that
    proved the secret, so the worker tries again each time (with its
    backoff), and prints the peer's reason escaped."""

    def refuse_at_once(c):
        c.sendall(refused(EVIL, True))
        return until_closed(c)

    def short_nonce(c):
        c.sendall(challenge(b"12345"))
        return until_closed(c)

    def other_protocol(c):
        c.sendall(challenge(os.urandom(32), protocol=99))
        return until_closed(c)

    def bad_proof(c):
        c.sendall(challenge(os.urandom(32)))
        read_join(c)
        c.sendall(accept(bytes(32)) + refused(b"you are refused", True))
        return until_closed(c)

    def check(fake, w):
        wait_for(lambda: len(fake.results) >= 4 or w.proc.poll() is not None, 30,
                 "four handshakes")
        assert w.proc.poll() is None, f"the worker exited ({w.proc.returncode})"
        assert all(isinstance(r, float) for r in fake.results[:4]), fake.results
        # And it comes back once more after the last.
        wait_for(lambda: fake.conns >= 5 or w.proc.poll() is not None, 30, "a fifth connection")
        assert w.proc.poll() is None, f"the worker exited ({w.proc.returncode})"
        err = w.stderr()
        assert EVIL_ESCAPED in err and b"\x1b" not in err, err
        assert err.count(b"not for good") >= 2, err
        assert b"could not prove it holds the secret" in err, err

    run([refuse_at_once, short_nonce, other_protocol, bad_proof, refuse_at_once], check)


@case
def proved_refusal():
    """A fake that holds the secret: it checks the worker's MAC, proves the
    secret back, then refuses for good; the worker takes that as final
    (exit 3) and prints the reason escaped."""

    def prove_then_refuse(c):
        theirs = os.urandom(32)
        c.sendall(challenge(theirs))
        nonce, got = read_join(c)
        assert hmac.compare_digest(got, mac(b"worker", theirs, nonce)), "the worker's MAC"
        c.sendall(accept(mac(b"daemon", nonce, theirs)) + refused(b"rank 9\x1b[31m", True))
        return until_closed(c)

    def check(fake, w):
        assert w.proc.wait(20) == 3, w.proc.returncode
        err = w.stderr()
        assert b"refused: rank 9\\x1b[31m" in err and b"\x1b" not in err, err
        assert fake.conns == 1 and isinstance(fake.results[0], float), fake.results

    run([prove_then_refuse], check)


@case
def big_frame():
    """A length prefix of 512 MiB before any proof, then bytes as fast as the
    worker takes them: the worker refuses the frame at once, without taking
    them in, and tries again."""

    def big(c):
        wait_for(lambda: fake_pid[0], 10, "the worker's pid")
        before = hwm(fake_pid[0])
        c.sendall(struct.pack("<I", 512 << 20))
        t0 = time.monotonic()
        sent = 0
        c.settimeout(5)
        try:
            while sent < 64 << 20 and time.monotonic() - t0 < 10:
                sent += c.send(bytes(1 << 20))
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        took = time.monotonic() - t0 + until_closed(c)
        return took, sent, hwm(fake_pid[0]) - before

    fake_pid = [None]

    def check(fake, w):
        fake_pid[0] = fake.worker_pid
        wait_for(lambda: fake.conns >= 2 or w.proc.poll() is not None, 30, "a second connection")
        assert w.proc.poll() is None, f"the worker exited ({w.proc.returncode})"
        took, sent, grew = fake.results[0]
        assert took < 3, f"the worker took {took:.1f} s to close ({sent} bytes sent)"
        assert grew < 16 << 20, f"the worker's peak memory grew by {grew >> 20} MiB"
        assert b"frame of 536870912 bytes" in w.stderr(), w.stderr()

    run([big, hang_up], check)


@case
def drip():
    """A peer that sends a frame one byte a second: the handshake gives up
    at its deadline (10 s from connecting), and the worker tries again."""

    def dribble(c):
        c.sendall(struct.pack("<I", 3000))
        t0 = time.monotonic()
        c.settimeout(1)
        while time.monotonic() - t0 < 3 * HANDSHAKE_S:
            try:
                c.send(b"\0")
                if c.recv(1) == b"":
                    break
            except socket.timeout:
                continue
            except OSError:
                break
        return time.monotonic() - t0

    def check(fake, w):
        wait_for(lambda: fake.conns >= 2 or w.proc.poll() is not None, 4 * HANDSHAKE_S,
                 "a second connection")
        assert w.proc.poll() is None, f"the worker exited ({w.proc.returncode})"
        took = fake.results[0]
        assert took < HANDSHAKE_S + 2, f"the dribbling peer held the worker {took:.1f} s"
        assert b"did not finish within 10 s" in w.stderr(), w.stderr()

    run([dribble, hang_up], check)


if __name__ == "__main__":
    sys.exit(run_cases(CASES, __doc__))
