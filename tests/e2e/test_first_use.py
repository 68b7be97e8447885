"""End-to-end tests of what a first-time user of ditd, ditctl and ditrun runs
into: refusals that say what would work, warnings for options that do
nothing, a visible warm-up and decode, honest queue positions and exit codes.

    test_first_use.py CASE      runs one case (meson registers each as a test)
    test_first_use.py --list    lists the cases
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon import children_of, Daemon, DEMO, env_path, run_cases  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(prompt="a red fox in the snow", width=64, height=64, num_inference_steps=4)

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def expect_error(fn, code, *needles):
    try:
        fn()
    except grpc.RpcError as e:
        details = e.details() or ""
        assert e.code().name == code, f"got {e.code().name} ({details!r}), expected {code}"
        for n in needles:
            assert n in details, f"{code} details {details!r} lack {n!r}"
        return details
    raise AssertionError(f"expected {code}, the call succeeded")


def run(*cmd, timeout=120):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------


@case
def serving():
    """Against a 2-rank ring mesh: refusals name the nearest valid size and
    keep the operator's hint for the log; true-CFG options that do nothing
    come back as Result.warnings and in the request log; the VAE decode is
    a progress stage; the running job counts as ahead in the queue; a
    cancelled request is logged as such; ditctl shows all of it."""
    d = Daemon("--ring", "2", world=2)
    exe = env_path("DITCTL")
    try:
        api = d.api

        # 13: what would work, for the client; what to configure, for the log.
        details = expect_error(lambda: d.generate(timeout=30, **dict(SMALL, width=48, height=48)),
                               "INVALID_ARGUMENT", "48x48", "nearest sizes that work",
                               "32x48", "64x48", "48x32", "48x64")
        assert "ring_anything" not in details and "unevenly" not in details, details
        assert "ring_anything splits them unevenly" in d.log(), d.log()
        details = expect_error(lambda: d.generate(timeout=30, **dict(SMALL, max_sequence_length=77)),
                               "INVALID_ARGUMENT", "max_sequence_length 77", "e.g. 76 or 78")
        assert "ring_anything" not in details, details
        expect_error(lambda: api.warmup(d.channel)(
            api.msg("ditserve.v1.WarmupRequest")(width=48, height=48), timeout=10),
            "INVALID_ARGUMENT", "nearest sizes that work")

        # 12: warnings, as diffusers gives them.
        _, png, res = d.generate(seed=1, negative_prompt="blurry", **SMALL)
        assert png.startswith(PNG_MAGIC)
        assert len(res.warnings) == 1 and "negative_prompt has no effect" in res.warnings[0], res
        _, _, res = d.generate(seed=1, true_cfg_scale=4.0, request_id="cfg-alone", **SMALL)
        assert len(res.warnings) == 1 and "true_cfg_scale 4 has no effect" in res.warnings[0], res
        _, _, res = d.generate(seed=1, true_cfg_scale=4.0, negative_prompt="blurry", **SMALL)
        assert list(res.warnings) == [], res.warnings
        _, _, res = d.generate(seed=1, **SMALL)
        assert list(res.warnings) == [], res.warnings
        line = [ln for ln in d.log().splitlines() if "id=cfg-alone" in ln]
        assert line and "status=OK detail=warning: true_cfg_scale 4 has no effect" in line[0], line

        # 15: every step, then the decode.
        call = api.generate(d.channel)(api.request(seed=1, **SMALL), timeout=60)
        stages = [(ev.progress.stage, ev.progress.step) for ev in call
                  if ev.WhichOneof("event") == "progress"]
        assert stages == [("denoising", 1), ("denoising", 2), ("denoising", 3),
                          ("denoising", 4), ("decoding", 4)], stages

        # 14: a job queued behind a running one has one job ahead of it.
        running = api.generate(d.channel)(
            api.request(seed=1, request_id="long-one", **dict(SMALL, num_inference_steps=1000)),
            timeout=600)
        for ev in running:
            if ev.WhichOneof("event") == "progress":
                break
        queued = api.generate(d.channel)(api.request(seed=1, **SMALL), timeout=600)
        first = next(queued)
        assert first.WhichOneof("event") == "queued" and first.queued.position == 1, first
        queued.cancel()

        # 16: the running job cancelled: the log says by whom, not "ok".
        running.cancel()
        d.wait_idle(30)
        line = [ln for ln in d.log().splitlines() if "request: id=long-one" in ln]
        assert line and "status=CANCELLED" in line[0], d.log()
        assert "detail=ok" not in line[0], line[0]
        assert "the client cancelled the call" in line[0], line[0]

        # ditctl: the daemon's warning (whether a negative prompt alone does
        # anything is the model's matter), the decode stage, 130 on Ctrl-C.
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "fox.png")
            p = run(exe, "--target", d.target, "generate", "--prompt", "fox", "--width", "64",
                    "--height", "64", "--steps", "4", "--negative-prompt", "blurry", "-o", out)
            assert p.returncode == 0, p.stderr
            assert ("warning from the daemon: negative_prompt has no effect: true "
                    "classifier-free guidance needs true_cfg_scale above 1") in p.stderr, p.stderr
            assert "decoding (VAE) after" in p.stderr, p.stderr
            assert "steps/s" in p.stderr or "s/step" in p.stderr, p.stderr
            t0 = time.monotonic()
            p = run(exe, "--target", d.target, "generate", "--prompt", "fox", "--steps", "4",
                    "-o", "/nonexistent/dir/x.png")
            assert p.returncode == 1 and "the folder /nonexistent/dir does not exist" in p.stderr
            assert time.monotonic() - t0 < 5
            # Long enough (seconds) that the signal lands mid-job.
            proc = subprocess.Popen([exe, "--target", d.target, "generate", "--prompt", "fox",
                                     "--width", "256", "--height", "256", "--steps", "1000",
                                     "-o", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            t0 = time.monotonic()
            while d.info().running == 0 and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            assert d.info().running == 1, "the job did not start"
            proc.send_signal(2)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 130, (proc.returncode, err)
        d.wait_idle(30)
        # The Ctrl-C cancelled the job on the daemon too.
        last = [ln for ln in d.log().splitlines() if "request: " in ln][-1]
        assert "steps=1000" in last and "status=CANCELLED" in last, last
        d.stop()
    finally:
        d.close()


@case
def warming_up():
    """The startup warm-up is visible: health NOT_SERVING, info (and ditctl
    info) mesh_state warming_up, then SERVING and ready; a mesh rebuilt
    after a worker's death is warmed up again before it serves."""
    d = Daemon("--warmup", "512x512:60", wait_serving=False)
    exe = env_path("DITCTL")
    try:
        H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
        NOT_SERVING = d.api.enum(H, "NOT_SERVING")
        states = set()
        t0 = time.monotonic()
        seen = None
        while time.monotonic() - t0 < 60:
            info = d.info()
            states.add(info.mesh_state)
            if info.mesh_state == "warming_up":
                seen = info
                assert d.health() == NOT_SERVING
                p = run(exe, "--target", d.target, "info")
                assert "mesh_state: warming_up" in p.stdout, p.stdout
                break
            time.sleep(0.02)
        assert seen is not None, f"never warming_up; saw {states}"
        assert seen.running == 1, seen
        d.wait_serving(120)
        assert d.info().mesh_state == "ready"
        # A rebuilt mesh is warmed up again before it serves.
        assert d.log().count("warm-up done") == 1, d.log()
        os.kill(children_of(d.proc.pid)[0], signal.SIGKILL)
        t0 = time.monotonic()
        while d.info().mesh_state == "ready" and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        while d.log().count("warm-up done") < 2 and time.monotonic() - t0 < 120:
            assert d.info().mesh_state != "ready" or d.log().count("warm-up done") == 2, \
                "the rebuilt mesh served before its warm-up"
            time.sleep(0.02)
        assert d.log().count("warm-up done") == 2, d.log()
        d.wait_serving(60)
        assert d.info().worker_restarts == 1
        d.stop()
    finally:
        d.close()


@case
def tools():
    """ditrun and ditd on first use: the output path is checked before any
    work, options that do nothing are warned about, a component folder as
    --model names the pipeline folder, and mistyped flags get a guess."""
    ditrun, ditd = env_path("DITRUN"), env_path("DITD")
    gen = [ditrun, "generate", "--model", DEMO, "--prompt", "fox", "--width", "64", "--height",
           "64", "--steps", "2"]
    # 11: refused at once, before loading anything.
    t0 = time.monotonic()
    p = run(*gen, "-o", "/nonexistent/dir/x.png")
    assert p.returncode == 1, p
    assert "cannot write /nonexistent/dir/x.png: the folder /nonexistent/dir does not exist" \
        in p.stderr, p.stderr
    assert "pipeline:" not in p.stdout and time.monotonic() - t0 < 5
    p = run(*gen, "-o", "/tmp/x.png", "--output-latents", "/nonexistent/l.safetensors")
    assert p.returncode == 1 and "/nonexistent/l.safetensors" in p.stderr, p.stderr
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "x.png")
        # 12: warnings, and none when both are given.
        p = run(*gen, "--negative-prompt", "blurry", "-o", out)
        assert p.returncode == 0, p.stderr
        assert "warning: --negative-prompt has no effect" in p.stderr, p.stderr
        p = run(*gen, "--true-cfg", "3", "-o", out)
        assert "warning: --true-cfg 3 has no effect" in p.stderr, p.stderr
        p = run(*gen, "--true-cfg", "3", "--negative-prompt", "blurry", "-o", out)
        assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    # 16: the transformer folder instead of the pipeline.
    comp = os.path.join(DEMO, "transformer")
    p = run(ditrun, "generate", "--model", comp, "--prompt", "x", "-o", "/tmp/x.png")
    assert p.returncode != 0 and "point --model at the pipeline folder" in p.stderr, p.stderr
    assert DEMO in p.stderr, p.stderr
    p = run(ditd, "--model", comp, "--listen", "127.0.0.1:0", timeout=60)
    assert p.returncode != 0 and "point --model at the pipeline folder" in p.stderr, p.stderr
    # 16: the nearest flag.
    p = run(ditrun, "generate", "--model", DEMO, "--promt", "x", "-o", "/tmp/x.png")
    assert p.returncode == 2 and "did you mean '--prompt'?" in p.stderr, p.stderr
    p = run(ditd, "--modle", DEMO)
    assert p.returncode == 2 and "did you mean '--model'?" in p.stderr, p.stderr


@case
def pid_one():
    """ditd as pid 1, as a container's entrypoint is (`docker run` of the
    image, a Kubernetes pod without an init): its workers start and it
    serves, a ring of two as much as one rank, and it drains and exits 0 on
    SIGTERM. (A worker took a parent of pid 1 for a daemon that had died
    and exited at once, so such a mesh restarted forever and never served;
    ditd now tells each worker its pid, --parent-pid.) Skipped where no pid
    namespace can be made (unshare needs CAP_SYS_ADMIN). The namespace has
    its own /proc (--mount-proc), as a container's has: the sanitizers read
    a process's threads there."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        print(f"skipped: unshare --pid: {probe.stderr.decode(errors='replace').strip()}")
        return 77
    # A ditd outside the namespace, sharing /tmp and /dev/shm: the pid-1
    # ditd's clean-up of what dead daemons left must not take its socket
    # folder (its pid means nothing in the new namespace; its lock does).
    neighbour = Daemon()
    try:
        with open(f"/proc/{neighbour.workers[0]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        folder = os.path.dirname(argv[argv.index(b"--connect") + 1].decode())
        run_pid_one()
        assert os.path.isdir(folder), f"the neighbour's socket folder {folder} was removed"
        # And it still rebuilds (its workers connect there) and serves.
        os.kill(neighbour.workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        while neighbour.info().worker_restarts < 1 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        neighbour.wait_serving(60)
        _, png, _ = neighbour.generate(seed=5, **SMALL)
        assert png.startswith(PNG_MAGIC)
        neighbour.stop()
    finally:
        neighbour.close()


@case
def worker_pid_one():
    """A joined worker as pid 1 of its namespace (a worker pod's container):
    SIGTERM ends it at once. (As pid 1 it had no handler, so the kernel
    dropped the signal and a pod's deletion waited its whole grace period
    for SIGKILL.) Skipped where no pid namespace can be made."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        print(f"skipped: unshare --pid: {probe.stderr.decode(errors='replace').strip()}")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("7f3a9c0e5b2d48e1a6c4f0b9d3e7a215\n")
        # Nothing listens on port 1: it retries, as a worker waiting for
        # its leader does.
        p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                              env_path("DITWORKER"), "--join", "127.0.0.1:1", "--secret-file",
                              secret], stderr=subprocess.PIPE)
        try:
            # Its first retry line: it runs (past its start-up) and waits.
            line = p.stderr.readline().decode()
            assert "cannot connect" in line, line
            (worker,) = children_of(p.pid)
            with open(f"/proc/{worker}/status") as f:
                nspid = next(line.split()[-1] for line in f if line.startswith("NSpid:"))
            assert nspid == "1", f"the worker is pid {nspid} in its namespace"
            os.kill(worker, signal.SIGTERM)
            rc = p.wait(10)
            assert rc == 128 + signal.SIGTERM, f"unshare returned {rc}"
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_pid_one():
    for world, flags in ((1, ()), (2, ("--ring", "2"))):
        d = Daemon(*flags, "--startup-timeout", "30", world=world, startup_s=30,
                   wrap=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"))
        try:
            (ditd,) = children_of(d.proc.pid)  # under unshare: pid 1 of its namespace
            with open(f"/proc/{ditd}/status") as f:
                nspid = next(line.split()[-1] for line in f if line.startswith("NSpid:"))
            assert nspid == "1", f"ditd is pid {nspid} in its namespace"
            kinds, png, res = d.generate(seed=3, **SMALL)
            assert png.startswith(PNG_MAGIC) and res.seed == 3, kinds
            assert d.info().worker_restarts == 0, d.info()
            # SIGTERM with a request running: it finishes, then ditd exits 0.
            out = {}
            t = threading.Thread(target=lambda: out.update(
                r=d.generate(timeout=120, seed=4, **dict(SMALL, num_inference_steps=200))))
            t.start()
            t0 = time.monotonic()
            while d.info().running == 0 and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            assert d.info().running == 1, "the request did not start"
            os.kill(ditd, signal.SIGTERM)
            t.join(120)
            assert "r" in out and out["r"][1].startswith(PNG_MAGIC), out
            assert d.proc.wait(60) == 0, d.log()
            print(f"  world {world}: served as pid 1, drained a running request")
        finally:
            d.close()


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
