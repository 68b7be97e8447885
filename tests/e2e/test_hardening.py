"""End-to-end tests of what adversarial and first-use testing found in ditd:
each case drives the real daemon (and its real workers) the way the attack
or the mistake did, over loopback.

    test_hardening.py CASE      runs one case (meson registers each as a test)
    test_hardening.py --list    lists the cases
"""

import json
import math
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import wait_for  # noqa: E402
from daemon import alive, children_of, Daemon, DEMO, env_path, generate_queued  # noqa: E402
from daemon import run_cases  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(prompt="a red fox in the snow", width=64, height=64, num_inference_steps=2)
LONG = dict(prompt="a very long job", width=512, height=512, num_inference_steps=1000)
# The demo model's text widths (tests/data/demo/transformer/config.json).
JOINT_DIM = 32
POOLED_DIM = 32

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def expect_error(fn, code, *needles):
    """Runs fn, which must fail with `code` and details holding each needle."""
    try:
        fn()
    except grpc.RpcError as e:
        details = e.details() or ""
        assert e.code().name == code, f"got {e.code().name} ({details!r}), expected {code}"
        for n in needles:
            assert n.lower() in details.lower(), f"{code} details {details!r} lack {n!r}"
        return details
    raise AssertionError(f"expected {code}, the call succeeded")


def ends_with(call, code):
    """Reads a stalled call to its end, which must be an error `code`."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        assert e.code() == code, e
        return
    raise AssertionError("a stalled call finished")


def wait_progress(call):
    for ev in call:
        if ev.WhichOneof("event") == "progress":
            return ev
    raise AssertionError("the stream ended before any progress")


def raw_generate(d, payload, timeout=30):
    """Sends bytes as a Generate request, whatever they are."""
    return list(d.channel.unary_stream("/ditserve.v1.Generation/Generate")(payload, timeout=timeout))


def raw_warmup(d, payload, timeout=30):
    return d.channel.unary_unary("/ditserve.v1.Generation/Warmup")(payload, timeout=timeout)


def no_sanitizer_reports(d):
    """In the sanitizer build, UBSan and ASan report on stderr (the log)."""
    log = d.log()
    for needle in ("runtime error:", "AddressSanitizer", "LeakSanitizer"):
        assert needle not in log, f"sanitizer report in the log:\n{log}"


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --------------------------------------------------------------------------


@case
def warmup_queued():
    """A Warmup that waits behind a running generation gets its one
    WarmupResponse and OK: queue-position updates go to Generate streams
    only (a Warmup call is unary)."""
    d = Daemon()
    try:
        api = d.api
        long_call = api.generate(d.channel)(api.request(seed=1, **LONG), timeout=300)
        wait_progress(long_call)
        wreq = api.msg("ditserve.v1.WarmupRequest")(width=64, height=64, num_inference_steps=1)
        fut = api.warmup(d.channel).future(wreq, timeout=60)
        # Another generation behind it moves the queue while the warm-up waits.
        gen2 = api.generate(d.channel)(api.request(seed=2, priority=-1, **SMALL), timeout=120)
        wait_for(lambda: d.info().queue_depth == 2, 30, "two queued requests")
        long_call.cancel()
        resp = fut.result(timeout=60)
        assert "64x64" in resp.detail and resp.elapsed_ms > 0, resp
        kinds, png, _ = ditapi.collect(gen2)
        assert kinds[0] == "queued" and kinds[-1] == "result" and png, kinds
        # And from a second client while idle: still fine.
        assert api.warmup(d.channel)(wreq, timeout=60).elapsed_ms > 0
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def stop_while_starting():
    """SIGTERM while a mesh's workers are still starting (each says hello
    only after the stop began, as a slow start would), with one mesh and
    with two: ditd stops and exits 0 within seconds, no worker left. (A late
    hello took the stopping mesh back to loading and ready, where its stop
    never completed: ditd hung until killed.)"""
    import stat
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        slow = os.path.join(tmp, "slow-worker")
        woke = os.path.join(tmp, "woke")
        go = os.path.join(tmp, "go")
        # Each worker waits for the go file, which the test makes once the
        # stop has begun.
        with open(slow, "w") as f:
            f.write(f"#!/bin/sh\nwhile [ ! -e {go} ]; do sleep 0.02; done\necho >> {woke}\n"
                    f"exec {env_path('DITWORKER')} \"$@\"\n")
        os.chmod(slow, stat.S_IRWXU)
        for flags, n in (((), 1), (("--replicas", "2", "--threads", "1"), 2)):
            for f in (woke, go):
                if os.path.exists(f):
                    os.unlink(f)
            d = Daemon("--worker", slow, *flags, wait_serving=False)
            try:
                # Spawned and waiting: their hello comes after the stop below.
                wait_for(lambda: len(children_of(d.proc.pid)) == n, 10, "the workers spawned")
                t0 = time.monotonic()
                def release():
                    # Once every mesh is stopping, the workers may go on.
                    wait_for(lambda: d.log().count("state: stopping") == n, 10, "the stop")
                    open(go, "w").close()
                d.stop(timeout_s=20, after_signal=release)
                took = time.monotonic() - t0
                print(f"  {' '.join(flags) or 'one mesh'}: stopped while starting in {took:.1f} s")
                assert took < 10, took
                assert "state: ready" not in d.log(), d.log()
                with open(woke) as f:  # they did wake and connect during the stop
                    assert len(f.read().split("\n")) - 1 == n
                no_sanitizer_reports(d)
            finally:
                d.close()


@case
def drain_during_warmup():
    """SIGTERM while the start-up warm-up (--warmup) runs and a request
    waits behind it (a ready mesh admits requests while it warms up): the
    warm-up stops at its next step and the accepted request is served
    within --drain-timeout; ditd exits 0. (The warm-up ran to its end first,
    and the request failed UNAVAILABLE when the drain timed out.)"""
    d = Daemon("--warmup", "512x512:1000", "--drain-timeout", "8", "--threads", "1",
               wait_serving=False)
    try:
        wait_for(lambda: "state: ready" in d.log(), 60, "the mesh ready and warming up")
        t, out = generate_queued(d, timeout=60, seed=1, **SMALL)
        assert d.info().running == 1, "the warm-up is not running"
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        t.join(60)
        r = out["r"]
        assert not isinstance(r, grpc.RpcError), f"{r.code().name}: {r.details()}"
        kinds, png, res = r
        assert png.startswith(PNG_MAGIC), kinds
        took = time.monotonic() - t0
        print(f"  the request was served {took:.1f} s after the signal")
        # At the warm-up's next step, not when the drain had nearly run out.
        assert took < 4, f"served {took:.1f} s after the signal"
        assert d.proc.wait(30) == 0, d.log()
        assert "warm-up failed" in d.log() and "shutting down" in d.log(), d.log()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def unread_results():
    """A client that stops reading (HTTP/2 window never reopened) while it
    keeps sending Generate calls: ditd holds at most --max-unread-bytes for
    its connection and --max-unread-total in all, refuses more with
    RESOURCE_EXHAUSTED, ends the stalled calls at their deadlines, serves
    other clients meanwhile, and does not wait on the stalled reader past
    --drain-timeout."""
    kib = 1 << 10
    d = Daemon("--max-unread-bytes", str(1024 * kib), "--max-unread-total", str(2048 * kib),
               "--drain-timeout", "3")
    try:
        api = d.api
        # 256x256 raw f32 RGB: 768 KiB a result. Without BDP probing the
        # client's window stays 64 KiB, and a call nobody iterates never
        # opens it: the rest of the result stays in ditd.
        big = dict(prompt="x", width=256, height=256, num_inference_steps=1,
                   output_format="OUTPUT_FORMAT_RAW_TENSOR")
        # Each channel on a connection of its own (grpcio shares connections
        # between channels with equal options otherwise).
        opts = [("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
        stalled = grpc.insecure_channel(d.target, options=opts)
        gen_a = api.generate(stalled)
        rss0 = rss_mib(d.proc.pid)

        def finished(rid):
            """Until ditd logged the request's end (grpcio sends a call
            after returning it, so an idle server proves nothing)."""
            wait_for(lambda: f"id={rid} " in d.log(), 60, f"the end of {rid}")

        # No deadlines: both results stay held through the checks below,
        # however slow the machine; they are cancelled after them.
        a1 = gen_a(api.request(seed=1, request_id="a1", **big))
        finished("a1")
        a2 = gen_a(api.request(seed=2, request_id="a2", **big))
        finished("a2")
        rss1 = rss_mib(d.proc.pid)
        # Over the connection's bound: refused at once, however often asked.
        for i in range(10):
            details = expect_error(lambda: list(gen_a(api.request(seed=3, **big), timeout=20)),
                                   "RESOURCE_EXHAUSTED", "--max-unread-bytes")
        rss2 = rss_mib(d.proc.pid)
        print(f"ditd RSS: {rss0:.0f} MiB at start, {rss1:.0f} with two unread 768 KiB results, "
              f"{rss2:.0f} after 10 more calls ({details})")
        # (The refusals are the bound; RSS is only reported: sanitizer builds
        # keep freed memory in quarantine.)
        # Another stalled connection, without a deadline: admitted (its
        # connection is clean, the total is under 2 MiB), then over the total.
        stalled2 = grpc.insecure_channel(d.target, options=opts)
        c1 = api.generate(stalled2)(api.request(seed=4, request_id="c1", **big))
        finished("c1")
        expect_error(lambda: d.generate(timeout=30, seed=5, **SMALL), "RESOURCE_EXHAUSTED",
                     "--max-unread-total")
        # Health and info still answer.
        assert d.info().running == 0
        # A stalled call ends at its deadline: a1 cancelled makes room on
        # the connection for a3 (deadline 2 s), which ends unread.
        def admitted(name, what, **kw):
            """A stalled call on a's connection once there is room (20 s at
            most): (the call, when it was sent)."""
            for k in range(100):
                rid = f"{name}-{k}"
                sent = time.monotonic()
                call = gen_a(api.request(seed=7, request_id=rid, **big), **kw)
                finished(rid)
                if re.search(rf"request: id={rid} .*status=OK", d.log()):
                    print(f"  room on the connection after {what}: try {k + 1}")
                    return call, sent
                assert re.search(rf"request: id={rid} .*status=RESOURCE_EXHAUSTED", d.log()), \
                    d.log()
                time.sleep(0.2)
            raise AssertionError(f"no room on the connection after {what}")

        a1.cancel()
        a3, sent = admitted("a3", "a1 was cancelled", timeout=2)
        # Read only after the deadline (reading would open the window).
        time.sleep(max(0.0, sent + 2.5 - time.monotonic()))
        ends_with(a3, grpc.StatusCode.DEADLINE_EXCEEDED)
        # ditd let a3 go at its deadline: room for another beside a2.
        a4, _ = admitted("a4", "a3's deadline")
        a4.cancel()
        a2.cancel()
        for call in (a1, a2, a4):
            ends_with(call, grpc.StatusCode.CANCELLED)
        t0 = time.monotonic()
        while True:
            try:
                kinds, png, _ = d.generate(timeout=30, seed=6, **SMALL)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                    time.monotonic() - t0 < 20, e
                time.sleep(0.2)
        assert kinds[-1] == "result" and png
        # c1 never reads and has no deadline: the drain gives it
        # --drain-timeout (3 s) and then ends it.
        t0 = time.monotonic()
        d.stop(timeout_s=30)
        took = time.monotonic() - t0
        print(f"drain with a stalled reader took {took:.1f} s")
        assert took < 15, f"the drain took {took:.1f} s"
        try:
            for _ in c1:
                pass
            raise AssertionError("c1 finished, though it never read and the drain ended")
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
        stalled.close()
        stalled2.close()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def small_methods():
    """Methods whose requests are a few names and numbers take at most
    16 KiB (reflection 64 KiB): a 1 MiB health check of unknown fields,
    which protobuf-c would unpack at dozens of times its size, is refused
    with RESOURCE_EXHAUSTED before it is read, without the token too, and
    ditd serves on. A reflection stream whose client reads nothing stops
    at about 1 MiB of unread answers on its connection instead of piling
    them up against --max-unread-total, which refuses everyone's Generate
    calls once full."""
    d = Daemon("--max-unread-total", str(2 << 20))
    try:
        api = d.api
        H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
        raw_check = d.channel.unary_unary("/grpc.health.v1.Health/Check",
                                          request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
        rss0 = rss_mib(d.proc.pid)
        # Field 15, varint 0, repeated: unknown to HealthCheckRequest.
        for size in (1 << 20, (16 << 10) + 2):
            details = expect_error(lambda: raw_check(b"\x78\x00" * (size // 2), timeout=20),
                                   "RESOURCE_EXHAUSTED", "at most 16384")
        print(f"  {details}; ditd RSS {rss0:.0f} -> {rss_mib(d.proc.pid):.0f} MiB")
        # Under the bound, unknown fields are fine (proto3 keeps them).
        assert raw_check(b"\x78\x00" * 100, timeout=10) is not None
        assert d.health() == api.enum(H, "SERVING")
        # Reflection answers nobody reads (the window stays 64 KiB).
        opts = [("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
        stalled = grpc.insecure_channel(d.target, options=opts)
        Req = api.msg("grpc.reflection.v1.ServerReflectionRequest")
        sent = threading.Event()

        def requests():
            for _ in range(400):  # about 10 KiB of answer each
                yield Req(file_containing_symbol="ditserve.v1.Generation")
            sent.set()
        stream = api.reflection(stalled)(requests(), timeout=120)
        assert sent.wait(30), "the requests were not taken"
        # Over the observation, ditd keeps serving Generate to others: its
        # unread total (2 MiB here) is not filled by the reflection answers.
        for k in range(5):
            kinds, png, _ = d.generate(timeout=60, seed=k, **SMALL)
            assert kinds[-1] == "result" and png
            time.sleep(0.2)
        answers = 0
        try:
            for _ in stream:
                answers += 1
            ended = "OK"
        except grpc.RpcError as e:
            ended = e.code().name
            assert ended == "RESOURCE_EXHAUSTED" and "unread" in e.details(), e
        print(f"  the stalled reflection stream: {answers} answers, then {ended}")
        assert ended == "RESOURCE_EXHAUSTED" or answers == 400, (answers, ended)
        stalled.close()
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


def check_log_lines(d, forged, json_format):
    with open(d.logf.name, "rb") as f:
        raw = f.read()
    raw.decode("utf-8")  # strict: no client bytes that are not UTF-8
    assert b"\x1b" not in raw, "an escape sequence reached the log"
    lines = d.log().splitlines()
    for line in lines:
        assert not line.startswith(forged), f"a forged log line: {line!r}"
        assert len(line) < 8192, f"a log line of {len(line)} bytes"
        if json_format and line.startswith("{"):
            json.loads(line)
    assert len(d.log()) < 200_000, f"the log is {len(d.log())} bytes"


def log_case(json_format):
    args = ["--log-json"] if json_format else []
    d = Daemon(*args)
    try:
        forged = "2026-01-01T00:00:00.000Z error ditd[1] main: FORGED"
        # A request_id with a newline is valid UTF-8 and accepted; it is
        # escaped in the log (and echoed intact to the client).
        kinds, _, _ = d.generate(seed=1, request_id="id\n" + forged, **SMALL)
        assert kinds[-1] == "result"
        call = d.api.generate(d.channel)(d.api.request(seed=1, request_id="x\r\n" + forged, **SMALL),
                                         timeout=60)
        evs = list(call)
        assert evs[0].request_id == "x\r\n" + forged
        # Refused requests: unknown model with a newline, 30 MB model and
        # request_id (their request lines are capped).
        expect_error(lambda: d.generate(timeout=30, model="m\n" + forged, **SMALL), "NOT_FOUND")
        # A model name that is not UTF-8: refused as such (the reply echoes
        # no model name that is not), and the log stays UTF-8.
        b = d.api.request(model="MODELMODEL", **SMALL).SerializeToString()
        bad = b.replace(b"MODELMODEL", b"\xff\xfe\n\x1b[31mRE")
        expect_error(lambda: raw_generate(d, bad), "INVALID_ARGUMENT", "model is not valid UTF-8")
        huge = "A" * (30 << 20)
        expect_error(lambda: d.generate(timeout=60, model=huge, **SMALL), "INVALID_ARGUMENT",
                     "model is 31457280 bytes; at most 256")
        expect_error(lambda: d.generate(timeout=60, request_id=huge, **SMALL), "INVALID_ARGUMENT",
                     "request_id")
        expect_error(lambda: d.generate(timeout=60, request_id=forged + "\n" + "B" * 200, **SMALL),
                     "INVALID_ARGUMENT", "request_id")
        # A cancelled queued request logs its id too.
        long_call = d.api.generate(d.channel)(d.api.request(seed=1, **LONG), timeout=300)
        wait_progress(long_call)
        queued = d.api.generate(d.channel)(d.api.request(seed=2, request_id="q\n" + forged, **SMALL),
                                           timeout=300)
        wait_for(lambda: d.info().queue_depth == 1, 30, "a queued request")
        queued.cancel()
        long_call.cancel()
        d.wait_idle(60)
        d.stop()
        check_log_lines(d, forged, json_format)
        log = d.log()
        if json_format:
            ids = [json.loads(l).get("request_id") for l in log.splitlines() if l.startswith("{")]
            assert "id\n" + forged in ids, "the request_id is not in the log"
        else:
            assert "id\\n" + forged.replace(" ", "\\x20") in log, "the escaped request_id is not in the log"
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def log_injection():
    """Text logs: newlines in request_id or model cannot forge a line, and
    a 30 MB field writes a capped line."""
    log_case(json_format=False)


@case
def log_injection_json():
    """The same with --log-json: every line stays one JSON object."""
    log_case(json_format=True)


@case
def bad_strings():
    """request_id must be UTF-8 and at most 128 bytes; no string field may
    hold a NUL byte (protobuf-c would cut it there). All INVALID_ARGUMENT;
    the daemon keeps serving."""
    d = Daemon()
    try:
        api = d.api

        def patched(marker, raw, **fields):
            b = api.request(**fields).SerializeToString()
            assert b.count(marker) == 1
            return b.replace(marker, raw)

        bad_id = patched(b"IDIDIDID", b"\xff\xfe\x80\xc0abcd", request_id="IDIDIDID", **SMALL)
        expect_error(lambda: raw_generate(d, bad_id), "INVALID_ARGUMENT", "request_id", "UTF-8")
        expect_error(lambda: d.generate(timeout=30, request_id="r" * 129, **SMALL),
                     "INVALID_ARGUMENT", "request_id", "128")
        kinds, _, _ = d.generate(timeout=60, seed=1, request_id="r" * 128, **SMALL)
        assert kinds[-1] == "result"
        # The UTF-8 check of request_id is strict (overlong, surrogate).
        for raw in (b"\xc0\xafabcdef", b"\xed\xa0\x80abcde"):
            payload = patched(b"IDIDIDID", raw, request_id="IDIDIDID", **SMALL)
            expect_error(lambda: raw_generate(d, payload), "INVALID_ARGUMENT", "UTF-8")
        # NUL bytes.
        for field in ("prompt", "prompt_2", "negative_prompt", "request_id"):
            fields = dict(SMALL)
            fields[field] = "abc\x00def"
            expect_error(lambda: d.generate(timeout=30, **fields), "INVALID_ARGUMENT", field, "NUL")
        expect_error(lambda: d.generate(timeout=30, model="demo\x00x", **SMALL), "INVALID_ARGUMENT",
                     "model", "NUL")
        wreq = api.msg("ditserve.v1.WarmupRequest")(model="demo\x00x", width=64, height=64)
        expect_error(lambda: api.warmup(d.channel)(wreq, timeout=30), "INVALID_ARGUMENT", "model",
                     "NUL")
        # A good id with non-ASCII letters is echoed back intact.
        call = api.generate(d.channel)(api.request(seed=1, request_id="réq-✓-1", **SMALL), timeout=60)
        evs = list(call)
        assert all(e.request_id == "réq-✓-1" for e in evs) and evs[-1].WhichOneof("event") == "result"
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def bad_tensors():
    """Tensor shapes whose product overflows, and NaN or infinite values,
    are refused with INVALID_ARGUMENT (and no undefined behaviour: the
    sanitizer build checks the log)."""
    d = Daemon()
    try:
        f32 = lambda *vals: struct.pack(f"<{len(vals)}f", *vals)
        pooled = ("DTYPE_F32", [1, POOLED_DIM], f32(*([0.1] * POOLED_DIM)))
        for shape in ([1, 4096, 1 << 62], [1, 1 << 62, JOINT_DIM], [1 << 40, 1 << 40, 1 << 40],
                      [-1, 4, JOINT_DIM], [1, 4, -(1 << 63)]):
            embeds = ("DTYPE_F32", shape, f32(*([0.0] * (4 * JOINT_DIM))))
            expect_error(lambda: d.generate(timeout=30, prompt_embeds=embeds,
                                            pooled_prompt_embeds=pooled, **SMALL),
                         "INVALID_ARGUMENT", "prompt_embeds")
        for bad in (math.nan, math.inf, -math.inf):
            vals = [0.0] * (4 * JOINT_DIM)
            vals[5] = bad
            embeds = ("DTYPE_F32", [1, 4, JOINT_DIM], f32(*vals))
            expect_error(lambda: d.generate(timeout=30, prompt_embeds=embeds,
                                            pooled_prompt_embeds=pooled, **SMALL),
                         "INVALID_ARGUMENT", "prompt_embeds", "NaN or infinity")
        nan_all = ("DTYPE_F32", [1, 4, JOINT_DIM], f32(*([math.nan] * (4 * JOINT_DIM))))
        expect_error(lambda: d.generate(timeout=30, prompt_embeds=nan_all,
                                        pooled_prompt_embeds=pooled, **SMALL),
                     "INVALID_ARGUMENT", "NaN")
        # bf16 (0x7fc0: NaN) and f16 (0x7c00: +inf) pooled embeddings.
        embeds = ("DTYPE_F32", [1, 4, JOINT_DIM], f32(*([0.1] * (4 * JOINT_DIM))))
        bf16 = ("DTYPE_BF16", [1, POOLED_DIM], struct.pack("<H", 0x7fc0) * POOLED_DIM)
        f16 = ("DTYPE_F16", [1, POOLED_DIM], struct.pack("<H", 0x3c00) * 31 + struct.pack("<H", 0x7c00))
        for p in (bf16, f16):
            expect_error(lambda: d.generate(timeout=30, prompt_embeds=embeds, pooled_prompt_embeds=p,
                                            **SMALL),
                         "INVALID_ARGUMENT", "pooled_prompt_embeds", "NaN or infinity")
        # Finite embeddings still generate.
        kinds, png, _ = d.generate(timeout=60, seed=1, prompt_embeds=embeds,
                                   pooled_prompt_embeds=pooled, **SMALL)
        assert kinds[-1] == "result" and png
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def port_in_use():
    """A second ditd on the port a running ditd holds exits non-zero naming
    the address (gRPC's SO_REUSEPORT would have let it share the port)."""
    d = Daemon()
    try:
        addr = d.target
        p = subprocess.run([env_path("DITD"), "--model", DEMO, "--listen", addr],
                           capture_output=True, timeout=60)
        err = p.stderr.decode(errors="replace")
        assert p.returncode != 0, f"the second ditd ran: {p.stdout!r} {err}"
        assert f"cannot listen on {addr}" in err and "in use" in err, err
        assert b"listening" not in p.stdout, p.stdout
        kinds, _, _ = d.generate(seed=1, **SMALL)
        assert kinds[-1] == "result"
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


@case
def listen_form():
    """--listen is checked before anything starts: a bad port or form exits
    2 at once with the expected form; ":PORT" means every interface."""
    for bad in ("127.0.0.1:99999", "50051", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:5x",
                "::1:50051", "[::1:50051", ""):
        t0 = time.monotonic()
        p = subprocess.run([env_path("DITD"), "--model", DEMO, "--listen", bad],
                           capture_output=True, timeout=30)
        err = p.stderr.decode(errors="replace")
        assert p.returncode == 2, f"--listen {bad!r}: rc {p.returncode}\n{err}"
        assert f"--listen '{bad}'" in err and "HOST:PORT" in err and ":50051" in err, err
        assert "chttp2" not in err and not p.stdout, err
        assert time.monotonic() - t0 < 10
    # The same through the environment.
    e = dict(os.environ, DITD_LISTEN="127.0.0.1:70000")
    p = subprocess.run([env_path("DITD"), "--model", DEMO], capture_output=True, timeout=30, env=e)
    assert p.returncode == 2 and b"0 to 65535" in p.stderr, p.stderr


def dead_pid():
    """A pid no process has now (that of a child that has exited)."""
    p = subprocess.Popen(["true"])
    p.wait()
    assert not alive(p.pid)
    return p.pid


def shm_of(pid):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"dit-{pid}-"))


def sock_dirs_of(pid):
    return sorted(n for n in os.listdir("/tmp") if n.startswith(f"ditd-{pid}-"))


@case
def stale_files():
    """kill -9 of ditd leaves nothing the next ditd does not remove: the
    shm segment is unlinked as soon as every rank has mapped it, and socket
    folders (and segments) named with a pid that is gone and whose lock
    nobody holds are reclaimed at start; those of live processes are kept,
    and so are those whose lock is held (a ditd in another pid namespace,
    whose pid means nothing here) and a folder without a lock a moment old
    (its owner about to take it)."""
    import fcntl
    gone = dead_pid()
    fake_seg = f"/dev/shm/dit-{gone}-abc123"
    fake_dir = f"/tmp/ditd-{gone}-Zq9xYz"
    live_seg = f"/dev/shm/dit-{os.getpid()}-keep"
    held_seg = f"/dev/shm/dit-{gone}-held"
    held_dir = f"/tmp/ditd-{gone}-HeLd00"
    young_dir = f"/tmp/ditd-{gone}-YoUng0"
    held = []
    d = d2 = None
    try:
        d = Daemon("--ring", "2", world=2)
        kinds, png, _ = d.generate(seed=1, **SMALL)
        assert kinds[-1] == "result" and png
        assert shm_of(d.proc.pid) == [], f"segments left while serving: {shm_of(d.proc.pid)}"
        dirs = sock_dirs_of(d.proc.pid)
        assert len(dirs) == 1, dirs
        # kill -9: the workers die with ditd; the socket folder stays.
        pid = d.proc.pid
        d.kill()
        assert sock_dirs_of(pid) == dirs
        # What an earlier ditd killed before its mesh was up would leave, and
        # a live process's segment.
        for path in (fake_seg, live_seg, held_seg):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        for folder in (fake_dir, held_dir, young_dir):
            os.mkdir(folder, 0o700)
            with open(os.path.join(folder, "ipc.sock"), "wb"):
                pass
        for folder in (fake_dir, held_dir):
            with open(os.path.join(folder, "owner.lock"), "wb"):
                pass
        # Held as a live ditd in another pid namespace holds them.
        for path in (held_seg, os.path.join(held_dir, "owner.lock")):
            f = open(path, "rb+")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(f)
        d2 = Daemon("--ring", "2", world=2)
        assert sock_dirs_of(pid) == [], f"the killed ditd's folder is still there: {dirs}"
        assert not os.path.exists(fake_seg) and not os.path.exists(fake_dir)
        assert os.path.exists(live_seg), "a live process's segment was removed"
        assert os.path.exists(held_seg) and os.path.isdir(held_dir), "a locked one was removed"
        assert os.path.isdir(young_dir), "a folder a moment old was removed"
        # d2 says what it removed. (Not asserted to be these three: a ditd of
        # another test starting at the same moment may reclaim some first;
        # that they are gone is what the asserts above check.)
        m = re.search(r"removed (\d+) socket folder\(s\) and shm segment\(s\)", d2.log())
        print(f"  d2 removed {m.group(1) if m else 0} stale folder(s) and segment(s)")
        kinds, png, _ = d2.generate(seed=1, **SMALL)
        assert kinds[-1] == "result" and png
        d2.stop()
        assert sock_dirs_of(d2.proc.pid) == [] and shm_of(d2.proc.pid) == []
        no_sanitizer_reports(d2)
    finally:
        for f in held:
            f.close()
        for path in (fake_seg, live_seg, held_seg) + tuple(
                os.path.join(f, n) for f in (fake_dir, held_dir, young_dir)
                for n in ("ipc.sock", "owner.lock")):
            if os.path.exists(path):
                os.unlink(path)
        for folder in (held_dir, young_dir):
            if os.path.isdir(folder):
                os.rmdir(folder)
        if os.path.isdir(fake_dir):
            os.rmdir(fake_dir)
        for x in (d, d2):
            if x:
                x.close()


@case
def metrics_idle():
    """1,200 idle connections and 200 slow ones (half a request header) on
    the metrics port: a scraper still gets its answer at once, again and
    again; idle connections are closed after their timeout."""
    d = Daemon("--metrics-port", "0")
    socks = []
    try:
        url = d.metrics_url
        port = int(url.rsplit(":", 1)[1].split("/")[0])

        def scrape():
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=5) as r:
                body = r.read().decode()
            assert r.status == 200 and "ditserve_requests_total" in body, body[:200]
            return time.monotonic() - t0

        for i in range(1400):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i >= 1200:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
        times = [scrape() for _ in range(5)]
        print(f"scrapes with 1,400 idle and slow connections opened: "
              f"{', '.join(f'{t * 1000:.0f} ms' for t in times)}")
        assert max(times) < 2.0, f"a scrape waited {max(times):.2f} s"
        # A few more idle ones between scrapes, as an attacker would.
        for _ in range(3):
            socks += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
            scrape()
        for s in socks:
            s.close()
        socks = []
        # Idle connections time out on their own.
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        socks.append(s)
        t0 = time.monotonic()
        assert s.recv(1) == b"", "an idle connection got data"
        waited = time.monotonic() - t0
        assert waited < 15, f"an idle connection stayed {waited:.1f} s"
        print(f"an idle connection was closed after {waited:.1f} s")
        kinds, _, _ = d.generate(seed=1, **SMALL)
        assert kinds[-1] == "result"
        scrape()
        d.stop()
        no_sanitizer_reports(d)
    finally:
        for s in socks:
            s.close()
        d.close()


# Values a hostile client tries in every field: boundaries, wrong signs,
# overflow, non-finite numbers, long and odd strings.
FUZZ_INTS = [0, 1, -1, 2, 16, 17, 48, 64, 65, 128, 129, 1000, 1001, 4096, 2**31 - 1, -2**31]
FUZZ_FLOATS = [0.0, 1.0, -1.0, 1.5, 3.5, 100.0, 101.0, math.nan, math.inf, -math.inf, 1e30, 1e-45]
FUZZ_STRINGS = ["", "demo", "style_a", "../../etc/passwd", "x" * 129, "x" * 70000, "caf\u00e9",
                "a\u2028b", "\u65e5\u672c", "%s%n", "\"}", "a\\b", "\x01\x7f", "\ud7ff\ue000"]
# Codes a bad request may get; UNKNOWN, INTERNAL, UNAVAILABLE and the like
# would be the daemon failing.
FUZZ_GRPC_OK = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED",
                "FAILED_PRECONDITION", "DEADLINE_EXCEEDED"}


def fuzz_grpc_request(api, rng):
    """A GenerateRequest from SMALL with one to four fields set to values
    from the pools above (tensors with random dtypes, shapes and lengths)."""
    r = api.request(seed=rng.randrange(2**64), **SMALL)
    fields = ["model", "prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "width",
              "height", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed",
              "output_format", "priority", "request_id", "max_sequence_length", "prompt_embeds",
              "pooled_prompt_embeds", "negative_prompt_embeds", "latents", "num_frames", "fps",
              "loras", "num_images"]
    for name in rng.sample(fields, rng.randint(1, 4)):
        f = r.DESCRIPTOR.fields_by_name[name]
        if name in ("guidance_scale", "true_cfg_scale"):
            getattr(r, name).value = rng.choice(FUZZ_FLOATS)
        elif name == "seed":
            getattr(r, name).value = rng.choice([0, 1, 2**64 - 1, 2**63])
        elif name == "loras":
            for _ in range(rng.randint(0, 10)):
                u = r.loras.add()
                u.name = rng.choice(FUZZ_STRINGS)
                u.scale = rng.choice(FUZZ_FLOATS)
        elif f.message_type is not None:  # a Tensor
            t = getattr(r, name)
            t.dtype = rng.randint(0, 5)
            t.shape.extend(rng.choice(FUZZ_INTS + [32, 8, 256]) for _ in range(rng.randint(0, 5)))
            t.data = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 4, 128, 1024, 2048])))
        elif f.type == f.TYPE_STRING:
            setattr(r, name, rng.choice(FUZZ_STRINGS))
        elif f.type == f.TYPE_ENUM:
            setattr(r, name, rng.randint(-1, 5))
        else:
            setattr(r, name, rng.choice(FUZZ_INTS))
    return r


def fuzz_bytes(data, rng):
    """data with a few bytes flipped, cut or repeated."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif b:
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 8)]
    return bytes(b)


FUZZ_JSON_VALUES = [None, True, False, 0, 1, -1, 2, 1.5, 2**53 + 1, 1e300, "", "auto", "64x64",
                    "0x0", "-64x64", "64x64x64", "99999999999x1", "b64_json", "url", "png", "x" * 5000,
                    [], [1, 2], {}, {"name": "style_a", "scale": 1}, [{"name": "../x"}],
                    [{"name": "style_a", "scale": "1"}], "\u00e9", "\ud7ff"]
FUZZ_HTTP_KEYS = ["model", "prompt", "negative_prompt", "n", "size", "response_format",
                  "output_format", "stream", "partial_images", "user", "seed",
                  "num_inference_steps", "guidance_scale", "true_cfg_scale", "priority", "loras",
                  "seconds", "fps", "num_frames", "quality", "x" * 300]


def fuzz_http_request(rng):
    """(method, path, headers, body bytes): mostly generation requests with
    fields of the wrong type or out of range, some broken as bytes, some on
    other methods and paths, with other content types."""
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2,
            "response_format": "b64_json", "seed": rng.randrange(1000)}
    for key in rng.sample(FUZZ_HTTP_KEYS, rng.randint(0, 3)):
        body[key] = rng.choice(FUZZ_JSON_VALUES)
    raw = json.dumps(body).encode()
    kind = rng.randrange(10)
    if kind == 0:
        raw = fuzz_bytes(raw, rng)
    elif kind == 1:  # invalid UTF-8 or a NUL inside a string
        i = raw.find(b'"', 2) + 1  # inside the first key or string
        raw = raw[:i] + rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\\u0000", b"\x00"]) + raw[i:]
    elif kind == 2:  # deep nesting
        depth = rng.choice([100, 10000])
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    method, path = "POST", "/v1/images/generations"
    if rng.randrange(8) == 0:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"])
    if rng.randrange(8) == 0:
        path = rng.choice(["/v1/models", "/v1/models/%00", "/v1/videos", "/v1/videos/../../etc",
                           "/v1/videos?limit=-1&after=%ff", "/v1/videos/video_x/content",
                           "/health", "/%ff%fe", "/v1/images/generations?x=" + "a" * 6000,
                           "/metrics", "//v1//images/generations"])
    ctype = rng.choice(["application/json"] * 6 + [
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
        "application/json; charset=latin1", None])
    headers = {"Content-Type": ctype} if ctype else {}
    return method, path, headers, raw


def http_raw(url, method, path, headers, body, timeout):
    """One request on its own connection; the status, or None when the
    daemon closed without answering, or "timeout"."""
    u = urllib.parse.urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=timeout)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        for k, v in headers.items():
            head += f"{k}: {v}\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        return "timeout", b""
    finally:
        s.close()
    if not data.startswith(b"HTTP/1."):
        return None, data
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), (head, rest)


@case
def fuzz_api():
    """Hostile requests in bulk, from a fixed seed (so a failure repeats):
    400 GenerateRequests with fields set to boundary, random and wrong
    values, 100 byte-mutated ones, and 400 HTTP requests (fields of the
    wrong type, broken JSON, invalid UTF-8, deep nesting, other methods,
    paths and content types). Each gets an answer: a gRPC status a bad
    request may get, with details; an HTTP status below 500 (or 503 when
    the queue is full), with an OpenAI-shaped JSON error for 4xx. The
    workers never restart, and the same request gives the same image before
    and after."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--max-pixels", str(128 * 128), "--max-queue", "64")
    try:
        api = d.api
        rng = random.Random(20261201)
        probe = dict(seed=5, **SMALL)
        _, before, _ = d.generate(timeout=60, **probe)
        codes = {}
        base = api.request(seed=1, **SMALL).SerializeToString()

        def send(payload, timeout):
            try:
                list(d.channel.unary_stream("/ditserve.v1.Generation/Generate")(payload,
                                                                                timeout=timeout))
                return "OK", ""
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""
        for i in range(500):
            payload = (fuzz_grpc_request(api, rng).SerializeToString() if i < 400
                       else fuzz_bytes(base, rng))
            code, details = send(payload, 3)
            if code == "DEADLINE_EXCEEDED":
                # Slow, or stuck? Given time, it must end with an answer.
                code, details = send(payload, 120)
                assert code != "DEADLINE_EXCEEDED", f"request {i} ({payload[:200]!r}) never ends"
            assert code in FUZZ_GRPC_OK, f"request {i} ({payload[:200]!r}): {code} {details!r}"
            assert code == "OK" or details, f"request {i}: {code} without details"
            codes[code] = codes.get(code, 0) + 1
        statuses = {}
        for i in range(400):
            method, path, headers, body = fuzz_http_request(rng)
            status, got = http_raw(d.http_url, method, path, headers, body, timeout=30)
            what = f"HTTP request {i}: {method} {path[:80]} {headers} {body[:200]!r}"
            assert status not in (None, "timeout"), f"{what}: no answer ({got!r:.200})"
            assert status < 500 or status == 503, f"{what}: {status} {got!r:.300}"
            if (400 <= status < 500 or status == 503) and method != "HEAD":
                hdr, rest = got
                assert b"application/json" in hdr.lower(), f"{what}: {hdr!r}"
                err = json.loads(rest)["error"]
                assert err["message"] and err["type"] and err["code"], f"{what}: {err}"
            statuses[status] = statuses.get(status, 0) + 1
        print("gRPC codes:", dict(sorted(codes.items())), "HTTP statuses:", dict(sorted(statuses.items())))
        # Most were refused, some ran: the pools reach both sides.
        assert codes.get("INVALID_ARGUMENT", 0) > 100 and codes.get("OK", 0) > 20, codes
        assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 20, statuses
        d.wait_idle(60)
        assert children_of(d.proc.pid) == d.workers, "a worker was restarted"
        _, after, _ = d.generate(timeout=60, **probe)
        assert after == before, "the same request gave another image after the fuzzing"
        d.stop()
        no_sanitizer_reports(d)
    finally:
        d.close()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
