"""End-to-end tests of LoRA adapters through ditd: the demo FLUX pipeline of
tests/data/demo served by a real ditd and ditworker, adapters from
tests/data/lora named in GenerateRequest.loras.

    test_lora.py CASE      runs one case (meson registers each as a test)
    test_lora.py --list    lists the cases
"""

import base64
import http.client
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import Daemon, DEMO, env_path, generate_queued, run_cases, wait_for  # noqa: E402

CASES = {}
LORA = os.path.join(env_path("DIT_SOURCE_ROOT"), "tests", "data", "lora")
SMALL = dict(prompt="a red fox in the snow", width=64, height=64, num_inference_steps=2, seed=7,
             output_format="OUTPUT_FORMAT_RAW_TENSOR")
TOL = 1e-5


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def floats(data):
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def read_safetensors(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        meta = header[name]
        assert meta["dtype"] == "F32", meta
        a, b = meta["data_offsets"]
        f.seek(8 + n + a)
        return floats(f.read(b - a))


def rel_error(got, want):
    assert len(got) == len(want), (len(got), len(want))
    worst = max(abs(g - w) for g, w in zip(got, want))
    return worst / max(abs(w) for w in want)


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


def ditrun_raw(tmp, lora=None):
    out = os.path.join(tmp, "ditrun.safetensors")
    cmd = [env_path("DITRUN"), "generate", "--model", DEMO, "--prompt", SMALL["prompt"],
           "--width", str(SMALL["width"]), "--height", str(SMALL["height"]),
           "--steps", str(SMALL["num_inference_steps"]), "--seed", str(SMALL["seed"]),
           "--output", out]
    if lora:
        cmd += ["--lora", lora]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return read_safetensors(out, "image")


def lora_dir(tmp):
    """A --lora-dir with the demo adapter and two files that cannot load."""
    d = os.path.join(tmp, "loras")
    os.mkdir(d)
    shutil.copy(os.path.join(LORA, "demo_peft.safetensors"), d)
    shutil.copy(os.path.join(LORA, "bad_unknown_key.safetensors"),
                os.path.join(d, "broken.safetensors"))
    with open(os.path.join(d, "garbage.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return d


# --------------------------------------------------------------------------


@case
def rank_cannot_read():
    """An adapter one rank cannot see (a joined worker whose host lacks the
    --lora-dir: here a mount namespace with an empty tmpfs over it): every
    rank skips the job at once instead of the others waiting in the forward
    until the comm timeout; the client hears that rank's own error, the
    mesh does not restart, and the next request runs."""
    worker = env_path("DITWORKER")
    with tempfile.TemporaryDirectory() as tmp:
        ldir = lora_dir(tmp)
        probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{ldir}'"],
                               capture_output=True, timeout=10)
        if probe.returncode != 0:
            print(f"SKIP: no mount namespace here ({probe.stderr.decode().strip()})")
            return 77
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("5c1e8f27a09b4d6e83f2c7a1b0d9e4f6\n")
        os.chmod(secret, 0o600)
        d = Daemon("--ring", "2", "--local-ranks", "1", "--join-listen", "127.0.0.1:0",
                   "--join-secret-file", secret, "--lora-dir", ldir, "--comm-timeout", "20",
                   world=2, wait_serving=False)
        joined = None
        try:
            logf = open(os.path.join(tmp, "joined.log"), "w")
            joined = subprocess.Popen(
                ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{ldir}' && exec '{worker}' "
                 f"--join {d.join_target} --secret-file '{secret}'"], stderr=logf)
            d.wait_serving(60)
            t0 = time.monotonic()
            details = expect_error(lambda: d.generate(loras=[("demo_peft", 0.8)], **SMALL),
                                   "INVALID_ARGUMENT", "demo_peft", "No such file")
            took = time.monotonic() - t0
            print(f"  refused in {took:.2f} s: {details}")
            assert took < 2, f"the other rank waited ({took:.1f} s)"
            assert "another rank" not in details, details
            kinds, data, _ = d.generate(**SMALL)
            assert kinds[-1] == "result" and data, "the mesh stopped serving"
            assert d.info().worker_restarts == 0, d.info()
            d.stop()
        finally:
            if joined and joined.poll() is None:
                joined.kill()
                joined.wait()
            d.close()


@case
def generate():
    """demo_peft at 0.8 through ditd equals ditrun --lora; the base output
    before and after it is bit-identical to a daemon without adapters."""
    with tempfile.TemporaryDirectory() as tmp:
        want_lora = ditrun_raw(tmp, os.path.join(LORA, "demo_peft.safetensors") + ":0.8")
        base_ref = Daemon()
        try:
            _, base, _ = base_ref.generate(**SMALL)
            base_ref.stop()
        finally:
            base_ref.close()
        d = Daemon("--lora-dir", lora_dir(tmp))
        try:
            _, before, _ = d.generate(**SMALL)
            assert before == base, "the base output changed with --lora-dir"
            _, got, res = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert list(res.shape) == [3, 64, 64], res.shape
            assert got != base, "the adapter changed nothing"
            err = rel_error(floats(got), want_lora)
            print(f"ditd demo_peft x 0.8 vs ditrun --lora: rel {err:.2g}")
            assert err <= TOL, err
            _, after, _ = d.generate(**SMALL)
            assert after == base, "the base output changed after an adapter"
            # The cached adapter gives the same again; scale 0 is the base.
            _, again, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert again == got
            _, zero, _ = d.generate(loras=[("demo_peft", 0.0)], **SMALL)
            assert zero == base
            log = d.log()
            assert "loras=demo_peft:0.8" in log or '"loras":"demo_peft:0.8"' in log, log
            # ditctl generate --lora NAME:SCALE makes the same image.
            raw = os.path.join(tmp, "ctl.safetensors")
            p = subprocess.run([env_path("DITCTL"), "--target", d.target, "generate", "--prompt",
                                SMALL["prompt"], "--width", "64", "--height", "64", "--steps",
                                "2", "--seed", "7", "--lora", "demo_peft:0.8", "--raw", "-o",
                                raw], capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stdout + p.stderr
            assert read_safetensors(raw, "image") == floats(got)
            p = subprocess.run([env_path("DITCTL"), "--target", d.target, "generate", "--prompt",
                                "x", "--lora", "nope", "-o", raw],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode != 0 and "NOT_FOUND" in p.stderr, p.stderr
            d.stop()
        finally:
            d.close()


@case
def mesh():
    """Every rank loads the adapter, sliced like its base weights: tp 2 x ring
    2 through ditd against ditrun --lora on one rank."""
    with tempfile.TemporaryDirectory() as tmp:
        want = ditrun_raw(tmp, os.path.join(LORA, "demo_peft.safetensors") + ":0.8")
        d = Daemon("--tp", "2", "--ring", "2", "--lora-dir", lora_dir(tmp), world=4)
        try:
            _, base, _ = d.generate(**SMALL)
            _, got, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            err = rel_error(floats(got), want)
            print(f"ditd tp 2 x ring 2, demo_peft x 0.8 vs ditrun --lora on one rank: rel {err:.2g}")
            assert err <= TOL, err
            _, again, _ = d.generate(**SMALL)
            assert again == base
            # A file that cannot load fails on every rank alike; the mesh serves on.
            expect_error(lambda: d.generate(loras=[("broken", 1.0)], **SMALL),
                         "INVALID_ARGUMENT", "broken.safetensors")
            _, again, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert again == got
            d.stop()
        finally:
            d.close()


@case
def refusals():
    """Unknown names, paths, bad scales, a daemon without adapters and files
    that cannot load are refused with a message; the daemon keeps serving."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon("--lora-dir", lora_dir(tmp))
        try:
            gen = lambda loras: d.generate(loras=loras, **SMALL)  # noqa: E731
            _, before, _ = gen([("demo_peft", 0.8)])
            expect_error(lambda: gen([("nope", 1.0)]), "NOT_FOUND", "no LoRA adapter named 'nope'")
            expect_error(lambda: gen([("../x", 1.0)]), "INVALID_ARGUMENT", "loras[0].name")
            expect_error(lambda: gen([("a/b", 1.0)]), "INVALID_ARGUMENT", "loras[0].name")
            expect_error(lambda: gen([("", 1.0)]), "INVALID_ARGUMENT", "loras[0].name")
            expect_error(lambda: gen([("x" * 129, 1.0)]), "INVALID_ARGUMENT", "loras[0].name")
            expect_error(lambda: gen([("demo_peft", float("nan"))]), "INVALID_ARGUMENT",
                         "loras[0].scale")
            expect_error(lambda: gen([("demo_peft", 101.0)]), "INVALID_ARGUMENT",
                         "loras[0].scale")
            expect_error(lambda: gen([("demo_peft", 1.0)] * 9), "INVALID_ARGUMENT",
                         "at most 8")
            expect_error(lambda: gen([("demo_peft", 1.0), ("demo_peft", 0.5)]),
                         "INVALID_ARGUMENT", "same adapter")
            expect_error(lambda: gen([("broken", 1.0)]), "INVALID_ARGUMENT",
                         "broken.safetensors", "transformer_blocks.0.attn.to_k")
            expect_error(lambda: gen([("garbage", 1.0)]), "INVALID_ARGUMENT",
                         "garbage.safetensors")
            # Still serving, adapters included: the same image as before them.
            _, got, _ = gen([("demo_peft", 0.8)])
            assert got == before
            d.stop()
        finally:
            d.close()
        d = Daemon()
        try:
            expect_error(lambda: d.generate(loras=[("demo_peft", 1.0)], **SMALL),
                         "FAILED_PRECONDITION", "no LoRA adapters", "--lora-dir")
            d.stop()
        finally:
            d.close()


@case
def preload():
    """--lora NAME=PATH: loaded at start and usable by name; only the names
    given; a file that cannot load is left out, the rest served."""
    with tempfile.TemporaryDirectory() as tmp:
        want = ditrun_raw(tmp, os.path.join(LORA, "demo_peft.safetensors") + ":0.5")
        d = Daemon("--lora", "fox=" + os.path.join(LORA, "demo_peft.safetensors") + ",bad=" +
                   os.path.join(LORA, "bad_unknown_key.safetensors"))
        try:
            _, got, _ = d.generate(loras=[("fox", 0.5)], **SMALL)
            err = rel_error(floats(got), want)
            assert err <= TOL, err
            # A preloaded file that cannot load is left out with a warning;
            # requests naming it get the reason.
            assert "--lora bad not preloaded" in d.log() and "lora_magnitude_vector" in d.log()
            expect_error(lambda: d.generate(loras=[("bad", 1.0)], **SMALL), "INVALID_ARGUMENT",
                         "bad_unknown_key.safetensors", "lora_magnitude_vector")
            # ditctl loras lists them; --unload of a preloaded one is refused.
            ctl = lambda *a: subprocess.run(  # noqa: E731
                [env_path("DITCTL"), "--target", d.target, "loras", *a], capture_output=True,
                text=True, timeout=60)
            p = ctl()
            assert p.returncode == 0, p.stderr
            lines = p.stdout.splitlines()
            assert lines[0] == "bad: not loaded, preloaded", lines
            assert lines[1].startswith("fox: loaded, ") and lines[1].endswith(" preloaded"), lines
            assert lines[2] == "cache limit per worker: 2147483648 bytes", lines
            p = ctl("--unload", "fox")
            assert p.returncode == 1 and "FAILED_PRECONDITION" in p.stderr, p.stderr
            p = ctl("--load", "fox")
            assert p.returncode == 0 and p.stdout.startswith("loaded fox ("), p.stdout
            expect_error(lambda: d.generate(loras=[("demo_peft", 1.0)], **SMALL), "NOT_FOUND",
                         "demo_peft")
            d.stop()
        finally:
            d.close()
        bad = subprocess.run([env_path("DITD"), "--model", DEMO, "--lora", "x=/nonexistent.st"],
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "/nonexistent.st" in bad.stderr, bad.stderr
        bad = subprocess.run([env_path("DITD"), "--model", DEMO, "--lora", "../x=/a"],
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "../x" in bad.stderr, bad.stderr


@case
def rpcs():
    """ListLoras lists --lora and --lora-dir adapters with what is loaded;
    LoadLora and UnloadLora change that (on a mesh, every rank alike: e2e
    lora_hot runs them on a ring of two); a cache bound of one
    byte keeps only the running job's adapters (and the preloaded one), a
    failed job's too, until a job without adapters; the
    metrics count loads, hits and evictions; all three RPCs want the bearer
    token like the rest."""
    import urllib.request
    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "token")
        with open(tok, "w") as f:
            f.write("s3cret-token-for-tests")
        ldir = lora_dir(tmp)
        shutil.copy(os.path.join(LORA, "demo_peft.safetensors"),
                    os.path.join(ldir, "demo_copy.safetensors"))
        d = Daemon("--lora-dir", ldir, "--lora-cache-bytes", "1", "--lora",
                   "fox=" + os.path.join(LORA, "demo_peft.safetensors"), "--auth-token-file",
                   tok, "--metrics-port", "0")
        md = (("authorization", "Bearer s3cret-token-for-tests"),)
        try:
            url = d.metrics_url
            api = d.api
            call = lambda m, **kw: api.lora_rpc(d.channel, m)(  # noqa: E731
                api.msg(f"ditserve.v1.{m}Request")(**kw), timeout=60, metadata=md)
            listed = lambda: {li.name: li for li in call("ListLoras").loras}  # noqa: E731
            gen = lambda name: ditapi.collect(api.generate(d.channel)(  # noqa: E731
                api.request(loras=[(name, 1.0)], **SMALL), timeout=120, metadata=md))
            expect_error(lambda: api.lora_rpc(d.channel, "ListLoras")(
                api.msg("ditserve.v1.ListLorasRequest")(), timeout=10), "UNAUTHENTICATED")
            expect_error(lambda: api.lora_rpc(d.channel, "LoadLora")(
                api.msg("ditserve.v1.LoadLoraRequest")(name="demo_peft"), timeout=10),
                "UNAUTHENTICATED")
            r = call("ListLoras")
            got = {li.name: li for li in r.loras}
            assert list(got) == ["broken", "demo_copy", "demo_peft", "fox", "garbage"], list(got)
            assert got["fox"].preloaded and got["fox"].loaded and got["fox"].bytes > 0, got["fox"]
            assert not got["demo_peft"].loaded and not got["demo_peft"].preloaded
            assert r.cache_limit_bytes == 1, r
            lr = call("LoadLora", name="demo_peft")
            assert lr.lora.loaded and lr.lora.bytes == got["fox"].bytes, lr
            assert listed()["demo_peft"].loaded
            # Over the bound: the next job's adapter pushes demo_peft out.
            gen("demo_copy")
            got = listed()
            assert got["demo_copy"].loaded and not got["demo_peft"].loaded and got["fox"].loaded
            assert call("LoadLora", name="demo_peft").lora.loaded
            assert not listed()["demo_copy"].loaded
            expect_error(lambda: call("LoadLora", name="broken"), "INVALID_ARGUMENT",
                         "broken.safetensors")
            expect_error(lambda: call("LoadLora", name="nope"), "NOT_FOUND", "nope")
            expect_error(lambda: call("LoadLora", name="../fox"), "INVALID_ARGUMENT", "name")
            expect_error(lambda: call("UnloadLora", name="fox"), "FAILED_PRECONDITION",
                         "preloaded")
            assert call("UnloadLora", name="demo_peft").was_loaded
            assert not call("UnloadLora", name="demo_peft").was_loaded
            got = listed()
            assert not got["demo_peft"].loaded and got["fox"].loaded
            gen("fox")
            # Jobs whose second adapter cannot load: the first, loaded for
            # each, is what the bound keeps, as for a job that ran, so
            # failing jobs do not pile adapters up past it.
            for first in ("demo_copy", "demo_peft"):
                expect_error(lambda: ditapi.collect(api.generate(d.channel)(
                    api.request(loras=[(first, 1.0), ("broken", 1.0)], **SMALL), timeout=120,
                    metadata=md)), "INVALID_ARGUMENT", "broken.safetensors")
            got = listed()
            assert got["demo_peft"].loaded and not got["demo_copy"].loaded, got
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            m = {l.split("{")[0]: float(l.split()[-1]) for l in text.splitlines()
                 if l.startswith("ditserve_lora")}
            # fox at start, demo_peft, demo_copy, demo_peft again, then
            # demo_copy and demo_peft for the failed jobs; fox from the cache.
            assert m["ditserve_lora_loads_total"] == 6, m
            assert m["ditserve_lora_cache_hits_total"] == 1, m
            assert m["ditserve_lora_evictions_total"] == 3, m
            assert m["ditserve_lora_cached_adapters"] == 2, m
            assert m["ditserve_lora_cached_bytes"] == 2 * got["fox"].bytes, m
            # A job without adapters trims what the last one kept past the
            # bound.
            ditapi.collect(api.generate(d.channel)(api.request(**SMALL), timeout=120,
                                                   metadata=md))
            got = listed()
            assert not got["demo_peft"].loaded and got["fox"].loaded, got
            d.stop()
        finally:
            d.close()


@case
def replicas():
    """With --replicas 2 each mesh keeps its own cache: an adapter used on
    both is loaded by both, and the metrics and ListLoras count both
    meshes' caches (not mesh 0's alone)."""
    import urllib.request
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon("--lora-dir", lora_dir(tmp), "--replicas", "2", "--threads", "1",
                   "--metrics-port", "0")
        try:
            url = d.metrics_url

            def lora_metrics():
                with urllib.request.urlopen(url, timeout=10) as resp:
                    text = resp.read().decode()
                return {l.split("{")[0]: float(l.split()[-1]) for l in text.splitlines()
                        if l.startswith("ditserve_lora")}
            # One long request holds a mesh; the second runs on the other.
            first = d.api.generate(d.channel)(d.api.request(
                loras=[("demo_peft", 0.8)], **dict(SMALL, num_inference_steps=1000)),
                timeout=300)
            assert any(ev.WhichOneof("event") == "progress" for ev in first)
            _, png, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert png
            first.cancel()
            d.wait_idle(30)
            assert [m.jobs for m in d.info().meshes] == [1, 1], d.info().meshes
            wait_for(lambda: lora_metrics().get("ditserve_lora_cached_adapters") == 2, 10,
                     "both meshes' caches in the metrics")
            m = lora_metrics()
            got = {li.name: li for li in d.api.lora_rpc(d.channel, "ListLoras")(
                d.api.msg("ditserve.v1.ListLorasRequest")(), timeout=10).loras}
            assert got["demo_peft"].loaded and got["demo_peft"].bytes > 0, got
            assert m["ditserve_lora_loads_total"] == 2, m
            assert m["ditserve_lora_cached_bytes"] == 2 * got["demo_peft"].bytes, m
            d.stop()
        finally:
            d.close()


@case
def hot():
    """LoadLora and UnloadLora while generations run (a two-rank mesh): the
    running one finishes unchanged, the next ones see the adapter come and
    go, and nothing is restarted."""
    import threading
    # Long enough that LoadLora and UnloadLora arrive while it runs (the
    # asserts below check that it still ran), short enough for CI.
    long_req = dict(SMALL, num_inference_steps=400)
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon("--lora-dir", lora_dir(tmp), "--ring", "2", world=2)
        try:
            _, alone, _ = d.generate(timeout=300, **long_req)
            _, with_lora_before, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            workers = d.workers
            call = lambda m, **kw: d.api.lora_rpc(d.channel, m)(  # noqa: E731
                d.api.msg(f"ditserve.v1.{m}Request")(**kw), timeout=300)

            def during(method):
                """method's RPC sent while the long generation runs; it
                waits in the queue behind it. Returns the generation's
                image and the RPC's response."""
                out = {}
                t = threading.Thread(target=lambda: out.update(r=d.generate(timeout=300,
                                                                          **long_req)))
                t.start()
                while d.info().running == 0 and t.is_alive():
                    time.sleep(0.005)
                assert d.info().running == 1, f"the long generation ended before {method}"
                fut = d.api.lora_rpc(d.channel, method).future(
                    d.api.msg(f"ditserve.v1.{method}Request")(name="demo_peft"), timeout=300)
                wait_for(lambda: d.info().queue_depth == 1, 30, f"{method} queued")
                assert t.is_alive(), f"the long generation ended before {method} queued"
                t.join(300)
                assert not t.is_alive() and "r" in out, f"the generation during {method} failed"
                return out["r"][1], fut.result(timeout=300)

            image, loaded = during("LoadLora")
            assert loaded.lora.loaded
            assert image == alone, "the generation running during LoadLora changed"
            _, got, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert got == with_lora_before
            image, unloaded = during("UnloadLora")
            assert unloaded.was_loaded
            assert image == alone, "the generation running during UnloadLora changed"
            listed = {li.name: li for li in call("ListLoras").loras}
            assert not listed["demo_peft"].loaded, listed
            # Named again, it loads again, and gives the same image.
            _, got, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert got == with_lora_before
            from daemon import children_of
            assert children_of(d.proc.pid) == workers, "workers were restarted"
            d.stop()
        finally:
            d.close()


def negated_b(src, dst):
    """A copy of adapter file src with every lora_B tensor's sign flipped:
    another version of the same adapter, which moves the image the other
    way."""
    with open(src, "rb") as f:
        data = bytearray(f.read())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    for name, e in header.items():
        if name == "__metadata__" or "lora_B" not in name:
            continue
        size = {"F32": 4, "F16": 2, "BF16": 2}[e["dtype"]]
        a, b = e["data_offsets"]
        for off in range(8 + n + a + size - 1, 8 + n + b, size):
            data[off] ^= 0x80  # the sign bit, in a little-endian element's last byte
    with open(dst, "wb") as f:
        f.write(data)


@case
def file_changes():
    """Adapter files that change while ditd serves (a two-rank mesh). A file
    replaced after its adapter was cached gives the new version on every
    rank (the workers keep adapters by file and version, and ditd names the
    version it saw), not the cached old one. A file gone between admission
    and the job's load is refused naming the file, not the server's folder.
    An adapter preloaded from a --lora-dir file cannot be unloaded under
    its file name."""
    import threading
    with tempfile.TemporaryDirectory() as tmp:
        ldir = lora_dir(tmp)
        new = os.path.join(tmp, "demo_peft_v2.safetensors")
        negated_b(os.path.join(LORA, "demo_peft.safetensors"), new)
        want_old = ditrun_raw(tmp, os.path.join(LORA, "demo_peft.safetensors") + ":0.8")
        want_new = ditrun_raw(tmp, new + ":0.8")
        assert want_new != want_old
        shutil.copy(os.path.join(LORA, "demo_peft.safetensors"),
                    os.path.join(ldir, "doomed.safetensors"))
        d = Daemon("--lora-dir", ldir, "--ring", "2", "--lora",
                   "style=" + os.path.join(ldir, "demo_peft.safetensors"), world=2)
        try:
            _, old, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            assert rel_error(floats(old), want_old) <= TOL
            # Replaced the way writers should (rename over it).
            staged = os.path.join(ldir, ".demo_peft.tmp")
            shutil.copy(new, staged)
            os.replace(staged, os.path.join(ldir, "demo_peft.safetensors"))
            _, got, _ = d.generate(loras=[("demo_peft", 0.8)], **SMALL)
            err = rel_error(floats(got), want_new)
            print(f"after the file was replaced: rel {err:.2g} to the new version, "
                  f"{rel_error(floats(got), want_old):.2g} to the old")
            assert err <= TOL, "the cached old version was used"
            # The preloaded name 'style' read the same file: it follows too.
            _, styled, _ = d.generate(loras=[("style", 0.8)], **SMALL)
            assert styled == got
            # Gone after admission: the request waits behind a long one.
            # (A long job, cancelled once the file is gone.)
            blocker = d.api.generate(d.channel)(d.api.request(
                prompt="a very long job", width=512, height=512, num_inference_steps=1000),
                timeout=600)
            assert any(ev.WhichOneof("event") == "progress" for ev in blocker)
            q, queued = generate_queued(d, timeout=120, loras=[("doomed", 1.0)], **SMALL)
            assert d.info().running == 1, d.info()
            os.unlink(os.path.join(ldir, "doomed.safetensors"))
            blocker.cancel()
            q.join(120)
            e = queued["r"]
            assert isinstance(e, grpc.RpcError), "a gone file was served"
            assert e.code().name == "INVALID_ARGUMENT", (e.code(), e.details())
            assert "doomed.safetensors" in e.details() and tmp not in e.details(), e.details()
            print(f"  gone after admission: {e.details()}")
            # UnloadLora of the preloaded file under its --lora-dir name.
            call = lambda m, **kw: d.api.lora_rpc(d.channel, m)(  # noqa: E731
                d.api.msg(f"ditserve.v1.{m}Request")(**kw), timeout=60)
            expect_error(lambda: call("UnloadLora", name="demo_peft"), "FAILED_PRECONDITION",
                         "preloaded adapter 'style'")
            assert {li.name: li for li in call("ListLoras").loras}["style"].loaded
            d.stop()
        finally:
            d.close()


@case
def fuse():
    """--lora-fuse merges an adapter at start: plain requests then equal
    ditrun --lora (unfused) within the tolerance, and a fuse that cannot
    happen stops ditd at start with a message."""
    with tempfile.TemporaryDirectory() as tmp:
        want = ditrun_raw(tmp, os.path.join(LORA, "demo_peft.safetensors") + ":0.8")
        base = ditrun_raw(tmp)
        d = Daemon("--lora-dir", lora_dir(tmp), "--lora-fuse", "demo_peft:0.8")
        try:
            _, got, _ = d.generate(**SMALL)
            err = rel_error(floats(got), want)
            moved = rel_error(floats(got), base)
            print(f"ditd --lora-fuse demo_peft:0.8 vs ditrun --lora: rel {err:.2g} "
                  f"(the base is {moved:.2g} away)")
            assert err <= TOL and moved > 100 * TOL, (err, moved)
            d.stop()
        finally:
            d.close()
        p = subprocess.run([env_path("DITD"), "--model", DEMO, "--lora-fuse", "nope"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "--lora-fuse nope: no adapter of that name" in p.stderr, \
            p.stderr
        p = subprocess.run([env_path("DITD"), "--model", DEMO, "--lora-dir", LORA,
                            "--lora-fuse", "demo_peft:abc"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "the scale must be a number" in p.stderr, p.stderr


def http_post(d, path, body):
    u = urllib.parse.urlsplit(d.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


@case
def http_loras():
    """POST /v1/images/generations takes 'loras' as [{"name", "scale"}] with
    the gRPC rules, and makes the image gRPC makes."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon("--lora-dir", lora_dir(tmp), "--http-listen", "127.0.0.1:0")
        try:
            gen = "/v1/images/generations"
            body = dict(prompt=SMALL["prompt"], size="64x64", seed=7, num_inference_steps=2,
                        response_format="b64_json")
            st, r = http_post(d, gen, {**body, "loras": [{"name": "demo_peft", "scale": 0.8}]})
            assert st == 200, (st, r)
            png = base64.b64decode(r["data"][0]["b64_json"])
            req = {k: v for k, v in SMALL.items() if k != "output_format"}
            _, want, _ = d.generate(loras=[("demo_peft", 0.8)], **req)
            _, base, _ = d.generate(**req)
            assert png == want and png != base
            st, r = http_post(d, gen, {**body, "loras": [{"name": "nope"}]})
            assert st == 404 and "nope" in r["error"]["message"], (st, r)
            for bad in ([{"name": "../x"}], [{"name": "a/b"}], {"name": "x"},
                        [{"name": "demo_peft", "scale": 1e9}], [{"name": "demo_peft", "s": 1}],
                        [{"name": "demo_peft"}] * 9, ["demo_peft"]):
                st, r = http_post(d, gen, {**body, "loras": bad})
                assert st == 400 and r["error"]["param"].startswith("loras"), (bad, st, r)
            st, r = http_post(d, gen, {**body, "loras": [{"name": "broken"}]})
            assert st == 400 and "broken.safetensors" in r["error"]["message"], (st, r)
            st, r = http_post(d, gen, {**body, "loras": []})
            assert st == 200 and base64.b64decode(r["data"][0]["b64_json"]) == base
            d.stop()
        finally:
            d.close()


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
