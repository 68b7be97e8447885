"""Starting and stopping a real ditd (with its real ditworker processes) for
the end-to-end tests."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

import ditapi


def env_path(name):
    v = os.environ.get(name)
    if not v:
        raise SystemExit(f"{name} is not set; run the tests through meson")
    return v


DEMO = os.path.join(env_path("DIT_SOURCE_ROOT"), "tests", "data", "demo")
WAN_DEMO = os.path.join(env_path("DIT_SOURCE_ROOT"), "tests", "data", "wan_demo")


def without_text_encoders(root, src=DEMO):
    """A pipeline folder at root with src's parts (symlinked) but its text
    encoders and tokenizers: requests to it must bring prompt_embeds."""
    os.makedirs(root)
    for name in os.listdir(src):
        if not name.startswith(("text_encoder", "tokenizer")):
            os.symlink(os.path.join(src, name), os.path.join(root, name))


def children_of(pid):
    """Pids whose parent is pid (the workers of a ditd)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


class Daemon:
    """One ditd on a free port. The log goes to a file the test can read;
    the files stay until remove_logs (a failing test prints them)."""

    logs = []

    def __init__(self, *args, world=1, env=None, startup_s=60, wait_serving=True, creds=None,
                 model=DEMO, wrap=()):
        self.api = ditapi.Api(env_path("DIT_DESC"))
        self.logf = tempfile.NamedTemporaryFile(prefix="ditd-", suffix=".log", delete=False)
        Daemon.logs.append(self.logf.name)
        # wrap: a command ditd runs under (its stdout stays ditd's).
        cmd = list(wrap) + [env_path("DITD"), "--model", model, "--listen", "127.0.0.1:0",
                            "--world-size", str(world)] + list(args)
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.logf, env=e)
        self.target = self._address("ditd: listening on ", "ditd did not start")
        self.join_target = None
        if "--join-listen" in args:
            self.join_target = self._address("ditd: workers join on ",
                                             "ditd printed no join address")
        self.metrics_url = None
        if "--metrics-port" in args:
            self.metrics_url = self._address("ditd: metrics on http://",
                                             "ditd printed no metrics address")
            self.metrics_url = self.metrics_url.replace("0.0.0.0", "127.0.0.1")
        self.http_url = None
        if "--http-listen" in args:
            # After the join and metrics lines, when those are asked for.
            for _ in range(3):
                line = self.proc.stdout.readline().decode()
                if line.startswith("ditd: http on "):
                    self.http_url = line.split()[-1]
                    break
            if not self.http_url:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"ditd printed no http address: {line!r}\n{self.log()}")
        self.creds = creds
        self.channel = self.connect()
        self.workers = []
        if wait_serving:
            self.wait_serving(startup_s)

    def _address(self, prefix, what):
        """The address ditd's next line of output gives after prefix."""
        line = self.proc.stdout.readline().decode()
        if not line.startswith(prefix):
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{what}: {line!r}\n{self.log()}")
        return line.split()[-1]

    def connect(self, creds=None):
        """A new channel to the daemon, with TLS when it serves TLS."""
        creds = creds or self.creds
        if creds is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, creds)

    def log(self):
        with open(self.logf.name, errors="replace") as f:
            return f.read()

    def finished(self, ids):
        """Those of the request ids whose jobs have ended, in the order of
        their request log lines (written as each job ends: with one mesh,
        the order the jobs ran in)."""
        return [m for m in re.findall(r"request: id=(\S+) ", self.log()) if m in ids]

    def health(self, service=""):
        req = self.api.msg("grpc.health.v1.HealthCheckRequest")(service=service)
        return self.api.health_check(self.channel)(req, timeout=10).status

    def wait_serving(self, timeout_s):
        serving = self.api.enum("grpc.health.v1.HealthCheckResponse.ServingStatus", "SERVING")
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if self.health() == serving:
                    self.workers = children_of(self.proc.pid)
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"ditd not SERVING within {timeout_s} s\n{self.log()}")

    def info(self):
        return self.api.server_info(self.channel)(
            self.api.msg("ditserve.v1.GetServerInfoRequest")(), timeout=10)

    def wait_idle(self, timeout_s):
        """Until nothing runs or waits; returns the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            i = self.info()
            if i.running == 0 and i.queue_depth == 0:
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError(f"ditd still busy after {timeout_s} s\n{self.log()}")

    def generate(self, timeout=120, **fields):
        call = self.api.generate(self.channel)(self.api.request(**fields), timeout=timeout)
        return ditapi.collect(call)

    def stop(self, sig=signal.SIGTERM, timeout_s=60, expect_rc=0, after_signal=None):
        """Signals ditd and checks it exits with expect_rc, leaving no worker.
        after_signal, if given, is called once the signal is sent."""
        workers = children_of(self.proc.pid) or self.workers
        self.channel.close()
        self.proc.send_signal(sig)
        if after_signal:
            after_signal()
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"ditd did not exit within {timeout_s} s\n{self.log()}")
        self.proc.stdout.close()
        t0 = time.monotonic()
        while any(alive(w) for w in workers) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        left = [w for w in workers if alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert rc == expect_rc, f"ditd exited {rc}, expected {expect_rc}\n{self.log()}"
        assert not left, f"workers {left} outlived ditd"
        return rc

    def kill(self):
        if self.proc.poll() is None:
            workers = children_of(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
            for w in workers:
                try:
                    os.kill(w, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.stdout.close()

    def close(self):
        if self.proc.poll() is None:
            self.kill()
        self.logf.close()

    @staticmethod
    def dump_logs():
        for name in Daemon.logs:
            with open(name, errors="replace") as f:
                print(f"----- {name}\n{f.read()}", file=sys.stderr)

    @staticmethod
    def remove_logs():
        for name in Daemon.logs:
            os.unlink(name)
        Daemon.logs.clear()


SANITIZER_NEEDLES = ("runtime error:", "AddressSanitizer", "LeakSanitizer", "ThreadSanitizer")


def wait_for(pred, timeout_s, what):
    """Until pred() holds (seconds it took); fails after timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def generate_queued(d, timeout=300, **fields):
    """Starts d.generate(**fields) on a thread while a mesh is busy and
    returns once ditd's queue holds it: (thread, out), where out["r"] is
    its (kinds, data, result) or its grpc.RpcError once the thread ends."""
    out = {}
    before = d.info().queue_depth

    def run():
        try:
            out["r"] = d.generate(timeout=timeout, **fields)
        except grpc.RpcError as e:
            out["r"] = e
    t = threading.Thread(target=run)
    t.start()
    t0 = time.monotonic()
    while d.info().queue_depth <= before and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    assert d.info().queue_depth == before + 1, "the request did not queue"
    return t, out


def run_cases(cases, doc):
    """The command line every e2e test file has: `FILE CASE` runs one case
    (meson registers each as a test), `FILE --list` lists them. A case may
    return 77 (skipped). In the sanitizer build, UBSan and ASan report on
    ditd's stderr: a report in any daemon's log fails the case. The logs are
    printed when the case fails and removed in any case."""
    if len(sys.argv) != 2 or sys.argv[1] not in cases and sys.argv[1] != "--list":
        print(doc)
        print("cases:", " ".join(cases))
        return 2
    if sys.argv[1] == "--list":
        print("\n".join(cases))
        return 0
    t0 = time.monotonic()
    try:
        rc = cases[sys.argv[1]]()
        for name in Daemon.logs:
            with open(name, errors="replace") as f:
                log = f.read()
            for needle in SANITIZER_NEEDLES:
                assert needle not in log, f"sanitizer report in {name}:\n{log}"
    except BaseException:
        Daemon.dump_logs()
        raise
    finally:
        Daemon.remove_logs()
    if rc == 77:
        return 77
    print(f"{sys.argv[1]}: ok ({time.monotonic() - t0:.1f} s)")
    return 0
