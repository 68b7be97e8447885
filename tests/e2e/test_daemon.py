"""End-to-end tests of ditd: the real daemon, real ditworker processes, real
gRPC, with a client written against the .proto in Python (grpcio).

    test_daemon.py CASE      runs one case (meson registers each as a test)
    test_daemon.py --list    lists the cases
"""

import math
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import wait_for  # noqa: E402
from daemon import alive, children_of, Daemon, DEMO, env_path, generate_queued  # noqa: E402
from daemon import run_cases  # noqa: E402
from daemon import WAN_DEMO, without_text_encoders  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(prompt="a red fox in the snow", width=64, height=64, num_inference_steps=4)
# Long enough that only a cancel, a deadline or a failure ends it early
# (25 ms a step on one core: 25 s and more).
LONG = dict(prompt="a very long job", width=512, height=512, num_inference_steps=1000)

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def code_of(err):
    return err.code().name


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


def wait_progress(call):
    """Reads a Generate stream until its first progress event."""
    for ev in call:
        if ev.WhichOneof("event") == "progress":
            return ev
    raise AssertionError("the stream ended before any progress")


# The daemons these tests compare with ditrun run a 2-rank ring: ditrun runs
# the same layout, so both do the same arithmetic. (A ring's attention
# merges partial results, which a single rank's does not: the two agree
# only to float rounding, and a value on a quantisation edge may then
# differ by one in the PNG, as it did on one CPU for num_images' seed.)
RING2 = ("--world-size", "2", "--ring", "2")


def ditrun_png(tmp, layout=RING2, **gen):
    out = os.path.join(tmp, "ditrun.png")
    cmd = [env_path("DITRUN"), "generate", "--model", DEMO, "--prompt", gen["prompt"],
           "--width", str(gen["width"]), "--height", str(gen["height"]),
           "--steps", str(gen["num_inference_steps"]), "--seed", str(gen["seed"]),
           "--output", out, *layout]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out, "rb") as f:
        return f.read()


# --------------------------------------------------------------------------


@case
def generate():
    """A generation over a 2-rank ring mesh: events in order, the PNG equal
    to ditrun's, raw tensors, chunking, seeds, priorities, info, models."""
    d = Daemon("--ring", "2", "--chunk-bytes", "1024", world=2)
    try:
        api = d.api
        kinds, png, res = d.generate(seed=7, request_id="fox-1", **SMALL)
        assert kinds[0] == "queued" and kinds[1] == "started", kinds
        prog = [k for k in kinds if k == "progress"]
        assert len(prog) == 4 + 1, kinds  # every step, then the VAE's "decoding"
        assert kinds[-1] == "result" and kinds.count("result") == 1, kinds
        assert kinds.count("chunk") == (len(png) + 1023) // 1024 >= 2, kinds
        assert png.startswith(PNG_MAGIC)
        assert res.width == 64 and res.height == 64 and res.seed == 7
        assert res.total_bytes == len(png)
        t = res.timings
        assert t.denoise_ms > 0 and t.total_ms >= t.denoise_ms and t.vae_ms > 0, t
        with tempfile.TemporaryDirectory() as tmp:
            ref = ditrun_png(tmp, seed=7, **SMALL)
        assert png == ref, "the daemon's PNG differs from ditrun generate's"

        # Every event carries the request id.
        call = api.generate(d.channel)(api.request(seed=7, request_id="fox-2", **SMALL), timeout=60)
        ids = {ev.request_id for ev in call}
        assert ids == {"fox-2"}, ids

        # Raw tensor: (3, H, W) f32, the PNG's pixels before quantisation.
        kinds, raw, res = d.generate(seed=7, output_format="OUTPUT_FORMAT_RAW_TENSOR", **SMALL)
        assert list(res.shape) == [3, 64, 64] and len(raw) == 3 * 64 * 64 * 4, res
        assert res.dtype == api.enum("ditserve.v1.DType", "DTYPE_F32")
        off = ditapi.png_matches_raw(png, raw, 64, 64)
        assert off <= 1, f"the PNG is {off} steps from the raw tensor quantised"

        # No seed: the daemon picks one and reports it; it reproduces the image.
        _, png_a, res_a = d.generate(**SMALL)
        _, png_b, res_b = d.generate(seed=res_a.seed, **SMALL)
        assert png_a == png_b and res_b.seed == res_a.seed

        # Priorities: with the mesh busy, a later high-priority request runs
        # before an earlier low-priority one. The order is read from ditd's
        # request log (one line as each job ends), not from client threads.
        busy = api.generate(d.channel)(api.request(priority=0, request_id="busy", seed=1, **LONG),
                                       timeout=600)
        wait_progress(busy)
        low, _ = generate_queued(d, priority=0, request_id="low", seed=1, **SMALL)
        high, _ = generate_queued(d, priority=5, request_id="high", seed=1, **SMALL)
        busy.cancel()
        for th in (low, high):
            th.join(120)
        ran = d.finished({"busy", "low", "high"})
        assert ran == ["busy", "high", "low"], ran

        info = d.info()
        assert info.world_size == 2 and info.layout.ring_degree == 2 and info.backend == "cpu", info
        assert info.mesh_state == "ready" and len(info.devices) == 2 and info.comm == "shm", info
        models = api.list_models(d.channel)(api.msg("ditserve.v1.ListModelsRequest")(), timeout=10)
        assert [m.name for m in models.models] == ["demo"], models
        m = models.models[0]
        assert m.pipeline == "FluxPipeline" and m.has_text_encoders, m
        assert m.task == api.enum("ditserve.v1.Task", "TASK_TEXT_TO_IMAGE"), m
        assert m.transformer == "FluxTransformer2DModel", m
        assert (m.default_width, m.default_height, m.default_steps) == (1024, 1024, 28), m
        assert (m.default_num_frames, m.default_fps) == (1, 0), m
        # ring 2 without an "anything" mode: token counts must split in two.
        assert (m.layout.size_multiple, m.layout.pixels_per_token, m.layout.token_divisor,
                m.layout.frame_step) == (16, 16, 2, 0), m
        assert m.config["joint_attention_dim"] == 32 and m.config["vae_scale_factor"] == 8, m
        assert info.model == m, info
        wr = api.warmup(d.channel)(api.msg("ditserve.v1.WarmupRequest")(width=64, height=64,
                                                                         num_inference_steps=1),
                                   timeout=60)
        assert wr.elapsed_ms > 0 and "64x64" in wr.detail, wr
        d.stop()
    finally:
        d.close()


@case
def num_images():
    """num_images 2 over a 2-rank ring mesh: each image its own chunks
    (image_index, offsets within the image), Result.image_bytes, both PNGs
    equal to ditrun generate --num-images 2's on the same ring; 9 is refused.
    num_images 3 on a two-thread worker (encoded in parallel): ditrun's PNGs."""
    d = Daemon("--ring", "2", "--chunk-bytes", "1024", world=2)
    try:
        api = d.api
        call = api.generate(d.channel)(api.request(seed=7, num_images=2, **SMALL), timeout=120)
        images, res = {}, None
        for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "chunk":
                buf = images.setdefault(ev.chunk.image_index, b"")
                assert ev.chunk.offset == len(buf), "chunks out of order"
                assert ev.chunk.image_index == max(images), "images out of order"
                images[ev.chunk.image_index] = buf + ev.chunk.data
            elif kind == "result":
                res = ev.result
        assert sorted(images) == [0, 1], sorted(images)
        assert list(res.image_bytes) == [len(images[0]), len(images[1])], res
        assert res.total_bytes == len(images[0]) + len(images[1]) and res.seed == 7, res
        assert all(images[k].startswith(PNG_MAGIC) for k in images)
        assert images[0] != images[1], "the two images are the same"
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "n.png")
            subprocess.run([env_path("DITRUN"), "generate", "--model", DEMO, "--prompt",
                            SMALL["prompt"], "--width", "64", "--height", "64", "--steps", "4",
                            "--seed", "7", "--num-images", "2", "--output", out, *RING2],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for k in range(2):
                with open(os.path.join(tmp, f"n_{k}.png"), "rb") as f:
                    assert images[k] == f.read(), f"image {k} differs from ditrun's"
            # ditctl generate --num-images 2: the same two files.
            out = os.path.join(tmp, "c.png")
            p = subprocess.run([env_path("DITCTL"), "--target", d.target, "generate", "--prompt",
                                SMALL["prompt"], "--width", "64", "--height", "64", "--steps",
                                "4", "--seed", "7", "--num-images", "2", "-o", out],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, f"{p.returncode}\n{p.stdout}\n{p.stderr}"
            assert "wrote 2 images, " in p.stdout, p.stdout
            for k in range(2):
                with open(os.path.join(tmp, f"c_{k}.png"), "rb") as f:
                    assert images[k] == f.read(), f"ditctl's image {k} differs"
        # One image: one entry, image_index 0 (old clients see no change).
        kinds, png, res = d.generate(seed=7, **SMALL)
        assert list(res.image_bytes) == [len(png)] and res.total_bytes == len(png), res
        expect_error(lambda: list(api.generate(d.channel)(
            api.request(seed=7, num_images=9, **SMALL), timeout=60)),
            "INVALID_ARGUMENT", "num_images 9 must be between 1 and 8")
        d.stop()
    finally:
        d.close()
    # One worker with two threads encodes the images in parallel: the same
    # PNGs, in order, as ditrun's one after the other (ditrun on two threads
    # too: the forward's last bits may follow the thread count).
    d = Daemon("--threads", "2")
    try:
        images, res = ditapi.collect_images(d.api.generate(d.channel)(
            d.api.request(seed=11, num_images=3, **SMALL), timeout=120))
        assert len(images) == 3 and list(res.image_bytes) == [len(p) for p in images], res
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "p.png")
            subprocess.run([env_path("DITRUN"), "generate", "--model", DEMO, "--prompt",
                            SMALL["prompt"], "--width", "64", "--height", "64", "--steps", "4",
                            "--seed", "11", "--num-images", "3", "--threads", "2",
                            "--output", out],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for k in range(3):
                with open(os.path.join(tmp, f"p_{k}.png"), "rb") as f:
                    assert images[k] == f.read(), f"image {k} differs from ditrun's"
        d.stop()
    finally:
        d.close()


@case
def health_reflection():
    """Health Check/Watch through a --warmup start, server reflection
    (v1 and v1alpha) from the embedded descriptors, unknown methods."""
    # A warm-up over the daemon's own size limits is refused at start, as
    # the Warmup call would refuse it.
    for flags, needle in [(["--warmup", "1024x1024:1", "--max-pixels", "65536"], "--max-pixels"),
                          (["--warmup", "4096x4096:1"], "--max-pixels")]:
        p = subprocess.run([env_path("DITD"), "--model", DEMO] + flags, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and needle in p.stderr, (flags, p.returncode, p.stderr)
    d = Daemon("--warmup", "512x512:60", wait_serving=False)
    try:
        api = d.api
        H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
        SERVING, NOT_SERVING = api.enum(H, "SERVING"), api.enum(H, "NOT_SERVING")
        watch = api.health_watch(d.channel)(api.msg("grpc.health.v1.HealthCheckRequest")(),
                                            timeout=120)
        first = next(watch).status
        assert first == NOT_SERVING, "SERVING before the warm-up ran"
        assert next(watch).status == SERVING
        watch.cancel()
        assert "warm-up done" in d.log()
        assert d.health() == SERVING and d.health("ditserve.v1.Generation") == SERVING
        expect_error(lambda: d.health("no.such.Service"), "NOT_FOUND", "unknown service")
        unknown = api.health_watch(d.channel)(
            api.msg("grpc.health.v1.HealthCheckRequest")(service="no.such.Service"), timeout=10)
        assert next(unknown).status == api.enum(H, "SERVICE_UNKNOWN")
        unknown.cancel()

        for version in ("v1", "v1alpha"):
            Req = api.msg(f"grpc.reflection.{version}.ServerReflectionRequest")
            reqs = [Req(list_services=""),
                    Req(file_containing_symbol="ditserve.v1.Generation"),
                    Req(file_containing_symbol="ditserve.v1.GenerateRequest.prompt"),
                    Req(file_by_filename="grpc/health/v1/health.proto"),
                    Req(file_containing_symbol="no.such.Thing"),
                    Req(file_containing_symbol="ditserve.v1.OUTPUT_FORMAT_PNG"),
                    Req(file_containing_symbol="ditserve.v1.Generation.Generate")]
            resps = list(api.reflection(d.channel, version)(iter(reqs), timeout=10))
            assert len(resps) == len(reqs)
            names = sorted(s.name for s in resps[0].list_services_response.service)
            assert names == sorted(["ditserve.v1.Generation", "grpc.health.v1.Health",
                                    "grpc.reflection.v1.ServerReflection",
                                    "grpc.reflection.v1alpha.ServerReflection"]), names
            from google.protobuf import descriptor_pb2
            files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                     for b in resps[1].file_descriptor_response.file_descriptor_proto]
            gen = [f for f in files if f.package == "ditserve.v1"]
            assert gen, [f.name for f in files]
            methods = {m.name for s in gen[0].service for m in s.method}
            assert {"Generate", "ListModels", "GetServerInfo", "Warmup"} <= methods, methods
            # Dependencies come along (wrappers for guidance_scale and seed).
            assert any(f.name == "google/protobuf/wrappers.proto" for f in files)
            assert resps[2].file_descriptor_response.file_descriptor_proto, "field symbol"
            hf = [descriptor_pb2.FileDescriptorProto.FromString(b)
                  for b in resps[3].file_descriptor_response.file_descriptor_proto]
            assert hf[0].name == "grpc/health/v1/health.proto"
            assert resps[4].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
            for k in (5, 6):
                assert resps[k].file_descriptor_response.file_descriptor_proto, reqs[k]

        # An unknown method answers UNIMPLEMENTED at once.
        t0 = time.monotonic()
        nope = d.channel.unary_unary("/ditserve.v1.Generation/Teleport")
        expect_error(lambda: nope(b"", timeout=10), "UNIMPLEMENTED", "Teleport")
        assert time.monotonic() - t0 < 5
        d.stop()
    finally:
        d.close()


def raw_generate(d, payload, timeout=30):
    """Sends bytes as a Generate request, whatever they are."""
    call = d.channel.unary_stream("/ditserve.v1.Generation/Generate")(payload, timeout=timeout)
    return list(call)


@case
def bad_requests():
    """Every bad request gets its own status and a message that says what is
    wrong, and the daemon goes on serving."""
    d = Daemon("--ring", "2", "--max-message-bytes", "200000", world=2)
    try:
        api = d.api
        jd = 32  # the demo's joint_attention_dim and pooled_projection_dim

        def gen(**fields):
            return lambda: d.generate(timeout=30, **fields)

        def f32(*shape):
            n = 1
            for s in shape:
                n *= s
            return ("DTYPE_F32", list(shape), b"\0" * (4 * n))

        cases = [
            (gen(**dict(SMALL, width=100)), "INVALID_ARGUMENT", "width 100", "multiple of 16"),
            (gen(**dict(SMALL, height=-16)), "INVALID_ARGUMENT", "height -16"),
            (gen(**dict(SMALL, width=4096, height=4096)), "INVALID_ARGUMENT", "max-pixels"),
            (gen(**dict(SMALL, num_inference_steps=5000)), "INVALID_ARGUMENT",
             "num_inference_steps 5000"),
            (gen(**dict(SMALL, num_inference_steps=-3)), "INVALID_ARGUMENT", "num_inference_steps"),
            (gen(**dict(SMALL, guidance_scale=float("nan"))), "INVALID_ARGUMENT", "guidance_scale"),
            (gen(**dict(SMALL, true_cfg_scale=-1.0)), "INVALID_ARGUMENT", "true_cfg_scale"),
            (gen(**dict(SMALL, max_sequence_length=600)), "INVALID_ARGUMENT", "max_sequence_length"),
            (gen(**dict(SMALL, num_frames=5)), "INVALID_ARGUMENT", "num_frames 5", "images"),
            (gen(**dict(SMALL, fps=24)), "INVALID_ARGUMENT", "fps 24"),
            (gen(**dict(SMALL, model="sdxl")), "NOT_FOUND", "sdxl", "demo"),
            (gen(**dict(SMALL, request_id="x" * 200)), "INVALID_ARGUMENT", "request_id"),
            # Above the daemon's own jobs (LoRA loads, warm-ups), which run first.
            (gen(**dict(SMALL, priority=2**31 - 1)), "INVALID_ARGUMENT", "priority 2147483647"),
            # output_format = 7 (field 12, varint), past the enum's values.
            (lambda: raw_generate(d, api.request(**SMALL).SerializeToString() + b"\x60\x07"),
             "INVALID_ARGUMENT", "output_format 7"),
            (gen(**dict(SMALL, prompt="p" * 70000)), "INVALID_ARGUMENT", "prompt is 70000 bytes"),
            (gen(**dict(SMALL, prompt_embeds=f32(1, 5, jd + 1), pooled_prompt_embeds=f32(1, jd))),
             "INVALID_ARGUMENT", "prompt_embeds must have shape (1, L, 32)"),
            (gen(**dict(SMALL, prompt_embeds=("DTYPE_UNSPECIFIED", [1, 4, jd], b"\0" * 512),
                        pooled_prompt_embeds=f32(1, jd))),
             "INVALID_ARGUMENT", "prompt_embeds.dtype"),
            (gen(**dict(SMALL, prompt_embeds=("DTYPE_BF16", [1, 4, jd], b"\0" * 100),
                        pooled_prompt_embeds=f32(1, jd))),
             "INVALID_ARGUMENT", "prompt_embeds holds 100 bytes", "needs 256"),
            (gen(**dict(SMALL, prompt_embeds=f32(1, 4, jd))), "INVALID_ARGUMENT",
             "pooled_prompt_embeds come together"),
            (gen(**dict(SMALL, prompt_embeds=f32(1, 4, jd), pooled_prompt_embeds=f32(2, jd))),
             "INVALID_ARGUMENT", "pooled_prompt_embeds must have shape (1, 32)"),
            (gen(**dict(SMALL, latents=f32(1, 15, 16))), "INVALID_ARGUMENT",
             "latents must have shape (1, 16, 16)"),
            (gen(**dict(SMALL, true_cfg_scale=4.0, prompt_embeds=f32(1, 4, jd),
                        pooled_prompt_embeds=f32(1, jd), negative_prompt_embeds=f32(1, 6, jd),
                        negative_pooled_prompt_embeds=f32(1, jd))),
             "INVALID_ARGUMENT", "negative_prompt_embeds must have shape (1, 4, 32)"),
            # 48x48 is 9 image tokens: plain ring over 2 ranks needs an even count.
            (gen(**dict(SMALL, width=48, height=48)), "INVALID_ARGUMENT",
             "nearest sizes that work: 32x48, 64x48, 48x32, 48x64"),
            (lambda: raw_generate(d, b"\xff\xff\xff\xff garbage"), "INVALID_ARGUMENT",
             "not a valid ditserve.v1.GenerateRequest"),
            # Invalid UTF-8 in a string field.
            (lambda: raw_generate(d, b"\x12\x03a\xffb"), "INVALID_ARGUMENT"),
            (gen(**dict(SMALL, prompt="q" * 300000)), "RESOURCE_EXHAUSTED", "larger than max"),
            (lambda: api.warmup(d.channel)(api.msg("ditserve.v1.WarmupRequest")(width=33),
                                           timeout=10),
             "INVALID_ARGUMENT", "width 33"),
            (lambda: api.warmup(d.channel)(api.msg("ditserve.v1.WarmupRequest")(model="x"),
                                           timeout=10),
             "NOT_FOUND", "'x'"),
            (lambda: d.channel.unary_unary("/grpc.health.v1.Health/Check")(b"\x0a\xff", timeout=10),
             "INVALID_ARGUMENT"),
        ]
        assert len(cases) >= 15
        for i, (fn, code, *needles) in enumerate(cases):
            details = expect_error(fn, code, *needles)
            print(f"  bad request {i + 1:2d}: {code}: {details}")
            if i % 6 == 5:
                kinds, png, _ = d.generate(seed=3, **SMALL)
                assert png.startswith(PNG_MAGIC), "the daemon stopped serving"
        kinds, png, res = d.generate(seed=3, **SMALL)
        assert png.startswith(PNG_MAGIC) and kinds[-1] == "result"
        serving = api.enum("grpc.health.v1.HealthCheckResponse.ServingStatus", "SERVING")
        assert d.health() == serving
        assert d.info().worker_restarts == 0, "a bad request cost a worker"
        d.stop()
    finally:
        d.close()


@case
def cancel_and_deadline():
    """A client that cancels, or whose deadline passes, stops the job at the
    next step boundary and frees the mesh for the next request."""
    d = Daemon("--ring", "2", world=2)
    try:
        api = d.api
        # Cancel while running.
        call = api.generate(d.channel)(api.request(seed=1, request_id="to-cancel", **LONG),
                                       timeout=600)
        wait_progress(call)
        t0 = time.monotonic()
        call.cancel()
        took = d.wait_idle(20)
        print(f"  cancel -> mesh idle in {took * 1000:.0f} ms")
        # At the next step boundary, not after the 1000 steps (25 s and more).
        assert took < 5, f"the mesh was busy {took:.1f} s after the cancel"
        assert re.search(r"id=to-cancel .*status=CANCELLED", d.log()), d.log()
        kinds, png, _ = d.generate(seed=2, **SMALL)
        assert png.startswith(PNG_MAGIC)

        # Cancel while queued: it leaves the queue; the running job goes on.
        running = api.generate(d.channel)(api.request(seed=1, request_id="running", **LONG),
                                          timeout=600)
        wait_progress(running)
        queued = api.generate(d.channel)(api.request(seed=1, request_id="queued-cancel", **SMALL),
                                         timeout=600)
        first = next(queued)
        # One job ahead of it: the running one.
        assert first.WhichOneof("event") == "queued" and first.queued.position == 1, first
        jobs0 = d.info().meshes[0].jobs
        queued.cancel()
        wait_for(lambda: d.info().queue_depth == 0, 10, "the cancelled request leaving the queue")
        # It left the queue while the running job still ran (not by running),
        # and the running job goes on: it reports more steps.
        info = d.info()
        assert info.queue_depth == 0 and info.running == 1, info
        step = wait_progress(running).progress.step
        assert wait_progress(running).progress.step > step, "the running job was disturbed"
        running.cancel()
        d.wait_idle(20)
        assert d.info().meshes[0].jobs == jobs0 + 1, "the cancelled request ran"
        assert re.search(r"id=queued-cancel .*status=CANCELLED", d.log()), d.log()
        assert re.search(r"id=running .*status=CANCELLED", d.log()), d.log()

        # Deadline while running.
        t0 = time.monotonic()
        expect_error(lambda: d.generate(timeout=1.0, seed=1, request_id="too-slow", **LONG),
                     "DEADLINE_EXCEEDED")
        took = d.wait_idle(20)
        print(f"  deadline -> mesh idle {took * 1000:.0f} ms after the client gave up")
        assert took < 5, f"the mesh was busy {took:.1f} s after the deadline"
        assert re.search(r"id=too-slow .*status=DEADLINE_EXCEEDED", d.log()), d.log()
        kinds, png, _ = d.generate(seed=2, **SMALL)
        assert png.startswith(PNG_MAGIC)
        assert d.info().worker_restarts == 0
        d.stop()
    finally:
        d.close()


@case
def worker_kill():
    """kill -9 of a worker mid-request: that request fails fast with
    UNAVAILABLE naming the rank, health drops and comes back, the queued
    request survives, the next request succeeds."""
    d = Daemon("--ring", "2", world=2)
    try:
        api = d.api
        H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
        states = []
        watching = threading.Event()

        def watch():
            w = api.health_watch(d.channel)(api.msg("grpc.health.v1.HealthCheckRequest")(),
                                            timeout=120)
            try:
                for r in w:
                    states.append(r.status)
                    watching.set()
                    if len(states) >= 3:
                        break
            except grpc.RpcError:
                pass

        watcher = threading.Thread(target=watch)
        watcher.start()
        # The watch is registered (its first status came) before the kill.
        assert watching.wait(30), "no first health status"
        call = api.generate(d.channel)(api.request(seed=1, request_id="victim", **LONG), timeout=600)
        wait_progress(call)
        qt, queued_result = generate_queued(d, seed=5, request_id="survivor", **SMALL)
        workers = children_of(d.proc.pid)
        assert len(workers) == 2, workers
        victim = workers[-1]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        details = expect_error(lambda: ditapi.collect(call), "UNAVAILABLE", "rank")
        failed_after = time.monotonic() - t0
        print(f"  in-flight request failed {failed_after * 1000:.0f} ms after the kill: {details}")
        assert failed_after < 10, "the failure took as long as a timeout"
        qt.join(300)
        assert not isinstance(queued_result["r"], grpc.RpcError), queued_result["r"]
        kinds, png, res = queued_result["r"]
        assert png.startswith(PNG_MAGIC) and res.seed == 5, "the queued request was lost"
        watcher.join(60)
        assert states[:3] == [api.enum(H, "SERVING"), api.enum(H, "NOT_SERVING"),
                              api.enum(H, "SERVING")], states
        info = d.info()
        assert info.worker_restarts == 1 and info.mesh_state == "ready", info
        new_workers = children_of(d.proc.pid)
        assert len(new_workers) == 2 and victim not in new_workers
        kinds, png, _ = d.generate(seed=6, **SMALL)
        assert png.startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


@case
def rank_stalled():
    """SIGSTOP of a worker mid-request (a rank that hangs without dying):
    its peer times out after --comm-timeout and reports it, the request
    fails with UNAVAILABLE naming the rank that stalled (not the peer that
    gave up and exited), the stopped worker is killed and the mesh rebuilt
    serves the next request."""
    d = Daemon("--ring", "2", "--comm-timeout", "3", world=2)
    try:
        call = d.api.generate(d.channel)(d.api.request(seed=1, **LONG), timeout=600)
        wait_progress(call)
        workers = children_of(d.proc.pid)
        assert len(workers) == 2, workers
        stalled = workers[-1]
        t0 = time.monotonic()
        os.kill(stalled, signal.SIGSTOP)
        details = expect_error(lambda: ditapi.collect(call), "UNAVAILABLE",
                               "waiting for rank(s) 1")
        print(f"  failed {time.monotonic() - t0:.1f} s after the stop: {details}")
        wait_for(lambda: d.info().worker_restarts == 1, 60, "restart")
        d.wait_serving(60)
        assert stalled not in children_of(d.proc.pid) and not alive(stalled)
        kinds, png, _ = d.generate(seed=6, **SMALL)
        assert png.startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


def cap_address_space(pid, extra_mib):
    """Caps a worker's address space (soft RLIMIT_AS) at what it maps now
    plus extra_mib: its next large allocation fails as a real out-of-memory
    would. extra_mib None lifts the cap."""
    if extra_mib is None:
        resource.prlimit(pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return
    with open(f"/proc/{pid}/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    resource.prlimit(pid, resource.RLIMIT_AS,
                     ((vm_kib + extra_mib * 1024) * 1024, resource.RLIM_INFINITY))


@case
def rank_out_of_memory():
    """A failure inside the forward (memory for the activations: each
    worker's address space capped a few MiB above what it maps, then a
    2048x2048 request). On every rank alike: the request fails with the
    ranks' own message and the same workers serve on. On one rank alone:
    the other is left waiting for it in a collective; the request fails
    within seconds with that rank's message, not after --comm-timeout, and
    the mesh is rebuilt and serves the next request."""
    big = dict(prompt="a lighthouse", width=2048, height=2048, num_inference_steps=1)
    d = Daemon("--ring", "2", "--comm-timeout", "30", world=2)
    try:
        workers = children_of(d.proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            cap_address_space(pid, 8)
        t0 = time.monotonic()
        details = expect_error(lambda: d.generate(seed=1, **big), "RESOURCE_EXHAUSTED",
                               "memory")
        print(f"  both ranks capped: failed after {time.monotonic() - t0:.2f} s: {details}")
        assert children_of(d.proc.pid) == workers and d.info().worker_restarts == 0
        # (Uncapped first: under ASan freed memory waits in quarantine, so
        # even a small request needs new mappings.)
        for pid in workers:
            cap_address_space(pid, None)
        kinds, png, _ = d.generate(seed=2, **SMALL)
        assert png.startswith(PNG_MAGIC), "the mesh did not serve on"

        cap_address_space(workers[1], 8)
        t0 = time.monotonic()
        details = expect_error(lambda: d.generate(seed=3, **big), "UNAVAILABLE",
                               "worker rank 1:", "memory", "rank 0 still waited for rank 1")
        failed_after = time.monotonic() - t0
        print(f"  rank 1 capped: failed after {failed_after:.2f} s: {details}")
        assert failed_after < 15, "the failure waited for --comm-timeout (30 s)"
        wait_for(lambda: d.info().worker_restarts == 1, 60, "restart")
        d.wait_serving(60)
        assert not set(children_of(d.proc.pid)) & set(workers), "the old workers remain"
        kinds, png, _ = d.generate(seed=4, **SMALL)
        assert png.startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


@case
def drain():
    """SIGTERM: NOT_SERVING, new work refused, accepted work finishes, exit 0.
    With a short drain timeout the job is cancelled. A second signal exits
    at once, and the workers do not outlive ditd."""
    d = Daemon("--ring", "2", "--drain-timeout", "60", world=2)
    try:
        api = d.api
        # A long job holds the mesh while the checks run (it is cancelled
        # after them); the queued one is the accepted work that must finish.
        call = api.generate(d.channel)(api.request(seed=1, request_id="long", **LONG), timeout=600)
        wait_progress(call)
        qt, queued = generate_queued(d, seed=2, request_id="accepted", **SMALL)
        d.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in d.log(), 10, "the drain")
        # New calls, on this connection or a new one, are refused with a
        # reason while the accepted ones run.
        other = grpc.insecure_channel(d.target)
        for ch in (d.channel, other):
            expect_error(lambda: ditapi.collect(api.generate(ch)(api.request(**SMALL), timeout=10)),
                         "UNAVAILABLE", "shutting down")
        H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
        assert d.health() == api.enum(H, "NOT_SERVING")
        other.close()
        call.cancel()
        qt.join(120)
        assert not isinstance(queued["r"], grpc.RpcError), queued["r"]
        kinds, png, res = queued["r"]
        assert kinds[-1] == "result" and png.startswith(PNG_MAGIC), "the drain lost the request"
        assert res.seed == 2, res
        rc = d.proc.wait(60)
        assert rc == 0, f"ditd exited {rc}\n{d.log()}"
        assert "NOT_SERVING" in d.log()
        for w in d.workers:
            assert not alive(w), "a worker outlived the drain"
    finally:
        d.close()

    d = Daemon("--ring", "2", "--drain-timeout", "1", world=2)
    try:
        api = d.api
        call = api.generate(d.channel)(api.request(seed=1, request_id="running", **LONG),
                                       timeout=600)
        wait_progress(call)
        queued = api.generate(d.channel)(api.request(seed=2, request_id="queued", **SMALL),
                                         timeout=600)
        wait_for(lambda: d.info().queue_depth == 1, 10, "the second request queued")
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        for c in (call, queued):
            try:
                ditapi.collect(c)
                raise AssertionError("a job finished despite the drain timeout")
            except grpc.RpcError as e:
                assert e.code().name in ("UNAVAILABLE", "CANCELLED"), e
        rc = d.proc.wait(60)
        # Both are in the request log, the queued one too.
        for rid in ("running", "queued"):
            assert re.search(rf"request: id={rid} .*status=UNAVAILABLE", d.log()), d.log()
        took = time.monotonic() - t0
        print(f"  drain timeout 1 s: ditd exited after {took:.1f} s")
        assert rc == 0, f"ditd exited {rc}\n{d.log()}"
        assert "drain timeout" in d.log()
        assert "did not exit in time" not in d.log(), "the workers ignored the cancel"
    finally:
        d.close()

    d = Daemon("--ring", "2", world=2)
    try:
        api = d.api
        call = api.generate(d.channel)(api.request(seed=1, **LONG), timeout=600)
        wait_progress(call)
        workers = children_of(d.proc.pid)
        d.proc.send_signal(signal.SIGINT)
        # The second signal after ditd took the first (signals do not queue).
        wait_for(lambda: "draining" in d.log(), 10, "the drain")
        d.proc.send_signal(signal.SIGINT)
        rc = d.proc.wait(30)
        assert rc == 1, f"second signal: ditd exited {rc}"
        t0 = time.monotonic()
        while any(alive(w) for w in workers) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "workers outlived an abrupt exit"
    finally:
        d.close()


@case
def load():
    """200 requests from 50 concurrent clients against a queue of 4: each
    gets a result or RESOURCE_EXHAUSTED, nothing hangs, ditd exits clean
    (leak-checked under the sanitizer build)."""
    d = Daemon("--ring", "2", "--max-queue", "4", world=2)
    try:
        api = d.api
        outcomes = []
        lock = threading.Lock()
        per_client = 4

        def client(k):
            ch = grpc.insecure_channel(d.target)
            try:
                for i in range(per_client):
                    req = api.request(seed=k * 100 + i, **dict(SMALL, num_inference_steps=2))
                    try:
                        kinds, png, res = ditapi.collect(api.generate(ch)(req, timeout=300))
                        ok = png.startswith(PNG_MAGIC) and res.seed == k * 100 + i
                        out = "OK" if ok else "BAD_RESULT"
                    except grpc.RpcError as e:
                        out = e.code().name
                    with lock:
                        outcomes.append(out)
            finally:
                ch.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(50)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        took = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a client hung"
        counts = {k: outcomes.count(k) for k in set(outcomes)}
        print(f"  200 requests, 50 clients, queue 4: {counts} in {took:.1f} s")
        assert len(outcomes) == 200
        assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"}, counts
        assert counts.get("OK", 0) >= 5 and counts.get("RESOURCE_EXHAUSTED", 0) >= 1, counts
        assert d.wait_idle(30) >= 0
        kinds, png, _ = d.generate(seed=9, **SMALL)
        assert png.startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


@case
def ditctl():
    """The C client against the real daemon: generate writes the same PNG a
    Python client gets, health/info/models/warmup/bench work."""
    d = Daemon("--ring", "2", world=2)
    exe = env_path("DITCTL")
    try:
        def run(*args, ok=True):
            p = subprocess.run([exe, "--target", d.target] + list(args), capture_output=True,
                               text=True, timeout=300)
            if ok:
                assert p.returncode == 0, f"ditctl {args}: {p.returncode}\n{p.stdout}\n{p.stderr}"
            return p

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "fox.png")
            run("generate", "--prompt", SMALL["prompt"], "--width", "64", "--height", "64",
                "--steps", "4", "--seed", "7", "-o", out)
            _, png, _ = d.generate(seed=7, **SMALL)
            with open(out, "rb") as f:
                assert f.read() == png, "ditctl and the Python client got different images"
        assert "SERVING" in run("health").stdout
        info = run("info").stdout
        assert "ring" in info and "cpu" in info, info
        assert "demo" in run("models").stdout
        run("warmup", "--width", "64", "--height", "64", "--steps", "1")
        bench = run("bench", "-n", "6", "-c", "3", "--prompt", "x", "--width", "64", "--height",
                    "64", "--steps", "2", "--quiet").stdout
        assert "p50" in bench and "OK" in bench, bench
        # Several concurrency levels: the same 3 requests at c = 1 then c = 2,
        # one table row each (concurrency, requests, ok, failed, req/s, p50,
        # p90, p99, max, overhead mean, overhead p50).
        bench = run("bench", "-n", "3", "-c", "1,2", "--prompt", "x", "--width", "64",
                    "--height", "64", "--steps", "2", "--quiet").stdout
        table = bench.split("\nper concurrency level (ms; ", 1)[1].splitlines()[1:]
        assert table[0].split()[0] == "concurrency", bench
        rows = [line.split() for line in table[1:] if line.strip()]
        assert [r[:4] for r in rows] == [["1", "3", "3", "0"], ["2", "3", "3", "0"]], bench
        for r in rows:
            rps, p50, p90, p99, mx, ovh_mean, ovh_p50 = map(float, r[4:])
            assert rps > 0 and 0 < p50 <= p90 <= p99 <= mx, bench
            # latency - queue - compute: what the daemon adds; small, never
            # below zero by more than the timers' rounding.
            assert -1.0 < ovh_mean < p50 and -1.0 < ovh_p50 < p50, bench
        for bad in ("0", "1,,2", "x", "1025", "1,2,"):
            p = run("bench", "-n", "1", "-c", bad, "--prompt", "x", ok=False)
            assert p.returncode == 2 and "-c wants concurrency levels from 1 to 1024" in p.stderr, \
                (bad, p.returncode, p.stderr)
        bad = run("generate", "--prompt", "x", "--width", "100", "-o", "/dev/null", ok=False)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr, bad.stderr
        d.stop()
    finally:
        d.close()


def make_certs(tmp):
    """A CA, a server certificate for 127.0.0.1/localhost and a client
    certificate, made with openssl; returns the PEM bytes by name."""
    def ssl(*args):
        subprocess.run(["openssl"] + list(args), cwd=tmp, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=ditserve-test-ca")
    with open(os.path.join(tmp, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out",
        "other.pem", "-days", "2", "-subj", "/CN=someone-else")
    out = {}
    for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem",
              "other.key"):
        with open(os.path.join(tmp, n), "rb") as f:
            out[n] = f.read()
    return out


@case
def tls_auth():
    """Mutual TLS and a bearer token: the right client is served; plaintext,
    no client certificate, a certificate from another CA, and a missing or
    wrong token are refused; health needs no token; the worker IPC socket
    is the daemon user's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        pem = make_certs(tmp)
        token = "s3cret-token-for-the-e2e-test"
        with open(os.path.join(tmp, "token"), "w") as f:
            f.write(token + "\n")
        good = grpc.ssl_channel_credentials(pem["ca.pem"], pem["client.key"], pem["client.pem"])
        d = Daemon("--tls-cert", os.path.join(tmp, "server.pem"),
                   "--tls-key", os.path.join(tmp, "server.key"),
                   "--tls-client-ca", os.path.join(tmp, "ca.pem"),
                   "--auth-token-file", os.path.join(tmp, "token"), creds=good)
        try:
            api = d.api
            auth = [("authorization", f"Bearer {token}")]
            call = api.generate(d.channel)(api.request(seed=7, **SMALL), timeout=60, metadata=auth)
            kinds, png, res = ditapi.collect(call)
            assert png.startswith(PNG_MAGIC) and res.seed == 7
            # Health is public: probes carry no token.
            assert d.health() == api.enum("grpc.health.v1.HealthCheckResponse.ServingStatus",
                                          "SERVING")
            info_req = api.msg("ditserve.v1.GetServerInfoRequest")()
            expect_error(lambda: api.server_info(d.channel)(info_req, timeout=10),
                         "UNAUTHENTICATED", "bearer token")
            expect_error(lambda: api.server_info(d.channel)(
                info_req, timeout=10, metadata=[("authorization", "Bearer " + token[:-1] + "X")]),
                "UNAUTHENTICATED")
            expect_error(lambda: ditapi.collect(api.generate(d.channel)(api.request(**SMALL),
                                                                        timeout=10)),
                         "UNAUTHENTICATED")
            # A refused Generate has its request-log line, like every other
            # refusal.
            assert re.search(r"request: id=- .*status=UNAUTHENTICATED", d.log()), d.log()
            # A message that is not a GenerateRequest: refused, and logged too.
            raw = grpc.RpcError
            bad = d.channel.unary_stream("/ditserve.v1.Generation/Generate",
                                         request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
            try:
                list(bad(b"\xff\xff\xff", timeout=10, metadata=auth))
                raise AssertionError("a message that is not a GenerateRequest was served")
            except raw as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert re.search(r"request: id=- .*status=INVALID_ARGUMENT detail=the request is not "
                             r"a valid", d.log()), d.log()
            assert api.server_info(d.channel)(info_req, timeout=10, metadata=auth).world_size == 1
            # The worker IPC socket: in a folder only the daemon's user can
            # enter, itself readable and writable by that user alone.
            import stat
            with open(f"/proc/{d.workers[0]}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            sock = argv[argv.index(b"--connect") + 1].decode()
            folder = os.stat(os.path.dirname(sock))
            assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid(), folder
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600, oct(os.stat(sock).st_mode)
            # Refused connections: plaintext, no client certificate, another CA.
            refused = [grpc.insecure_channel(d.target),
                       d.connect(grpc.ssl_channel_credentials(pem["ca.pem"])),
                       d.connect(grpc.ssl_channel_credentials(pem["ca.pem"], pem["other.key"],
                                                              pem["other.pem"]))]
            for ch in refused:
                expect_error(lambda: api.server_info(ch)(info_req, timeout=5, metadata=auth),
                             "UNAVAILABLE")
                ch.close()
            d.stop()
        finally:
            d.close()
        # A bad flag combination is refused before anything starts.
        p = subprocess.run([env_path("DITD"), "--model", DEMO, "--tls-cert",
                            os.path.join(tmp, "server.pem")], capture_output=True, text=True)
        assert p.returncode == 2 and "--tls-key" in p.stderr, p.stderr
        # A token too short, or whose line does not fit, is refused, not cut;
        # 511 characters fit.
        for token, needle in [("x" * 15, "shorter than 16"), ("x" * 600, "longer than 511"),
                              ("x" * 512 + "\n", "longer than 511"), ("x" * 511 + "\n", None)]:
            path = os.path.join(tmp, "token-" + str(len(token)))
            with open(path, "w") as f:
                f.write(token)
            # A join secret that is missing fails the start right after the
            # token is read: its message shows the token was taken.
            missing = os.path.join(tmp, "no-such-secret")
            p = subprocess.run([env_path("DITD"), "--model", DEMO, "--auth-token-file", path,
                                "--world-size", "2", "--ring", "2", "--local-ranks", "1",
                                "--join-listen", "127.0.0.1:0", "--join-secret-file", missing],
                               capture_output=True, text=True)
            assert p.returncode == 2, (len(token), p.stderr)
            assert (needle or "no-such-secret") in p.stderr, (len(token), p.stderr)
            assert needle or "token" not in p.stderr, p.stderr


@case
def json_logs():
    """--log-json: every line a JSON object; one request line per request
    with id, model, shape, steps, queue and compute times and the status."""
    import json
    d = Daemon("--log-json", "--log-level", "debug")
    try:
        d.generate(seed=1, request_id="json-1", **SMALL)
        expect_error(lambda: d.generate(timeout=10, **dict(SMALL, width=100)), "INVALID_ARGUMENT")
        d.stop()
        lines = [json.loads(l) for l in d.log().splitlines() if l.strip()]
        assert all("level" in l and "msg" in l or "request_id" in l for l in lines), lines[:3]
        reqs = [l for l in lines if l.get("request_id") == "json-1"]
        assert len(reqs) == 1, reqs
        r = reqs[0]
        assert r["model"] == "demo" and r["width"] == 64 and r["height"] == 64, r
        assert r["steps"] == 4 and r["status"] == "OK" and r["compute_ms"] > 0, r
        assert "queue_ms" in r
        bad = [l for l in lines if l.get("subsystem") == "request" and l["status"] == "INVALID_ARGUMENT"]
        assert len(bad) == 1 and "width 100" in bad[0]["detail"], bad
        assert any(l.get("level") == "debug" for l in lines), "--log-level debug had no effect"
    finally:
        d.close()


@case
def metrics():
    """Prometheus text on its own port, scraped during and after a
    generation: the running gauge, requests by status, step, queue and
    latency histograms, the mesh state, each rank's memory."""
    import urllib.error
    import urllib.request
    d = Daemon("--ring", "2", "--metrics-port", "0", "--warmup", "64x64:1", world=2)
    try:
        url = d.metrics_url

        def scrape():
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = r.read().decode()
            out = {}
            for l in text.splitlines():
                if l and not l.startswith("#"):
                    name, value = l.rsplit(" ", 1)
                    out[name] = float(value)
            return out

        api = d.api
        # 600 steps (a few seconds): still running when the scrape comes,
        # even on a loaded machine.
        call = api.generate(d.channel)(api.request(seed=1, **dict(SMALL, width=128, height=128,
                                                                  num_inference_steps=600)),
                                       timeout=300)
        wait_progress(call)
        during = scrape()
        assert during['ditserve_running_requests{model="demo"}'] == 1, during
        assert during['ditserve_mesh_state{model="demo",mesh="0",state="ready"}'] == 1
        kinds, png, _ = ditapi.collect(call)
        assert kinds[-1] == "result"
        expect_error(lambda: d.generate(timeout=10, **dict(SMALL, width=100)), "INVALID_ARGUMENT")
        # One that is not a GenerateRequest at all counts as well.
        not_a_request = d.channel.unary_stream("/ditserve.v1.Generation/Generate",
                                               request_serializer=lambda b: b,
                                               response_deserializer=lambda b: b)
        expect_error(lambda: list(not_a_request(b"\xff\xff\xff", timeout=10)),
                     "INVALID_ARGUMENT", "not a valid")
        after = scrape()
        ok = 'ditserve_requests_total{model="demo",status="OK"}'
        bad = 'ditserve_requests_total{model="demo",status="INVALID_ARGUMENT"}'
        assert after[ok] == 1 and after[bad] == 2, (after[ok], after[bad])
        # Requests per generation: the one generation, not the start-up warm-up.
        assert after['ditserve_batch_size_count{model="demo"}'] == 1, after
        assert after['ditserve_step_seconds_count{model="demo"}'] == 600
        assert after['ditserve_step_seconds_bucket{model="demo",le="+Inf"}'] == 600
        assert after['ditserve_request_seconds_count{model="demo"}'] == 1
        assert after['ditserve_request_seconds_sum{model="demo"}'] > 0
        assert after['ditserve_queue_seconds_count{model="demo"}'] == 1
        assert after['ditserve_running_requests{model="demo"}'] == 0
        assert after['ditserve_worker_restarts_total{model="demo",mesh="0"}'] == 0
        # Every rank reports its memory; GPU gauges only where there is a GPU.
        info = d.info()
        for r in range(2):
            rss = after[f'ditserve_worker_resident_bytes{{model="demo",mesh="0",rank="{r}"}}']
            assert rss > 4 << 20, (r, rss)
        gpu = [k for k in after if k.startswith("ditserve_gpu_memory")]
        if info.backend == "cpu":
            assert not gpu, gpu
        try:
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
            raise AssertionError("a path other than /metrics was served")
        except urllib.error.HTTPError as e:
            assert e.code == 404
        d.stop()
    finally:
        d.close()
    # A model name with a quote, a backslash, a newline and a byte that is
    # not UTF-8 (the folder's name, or --model-name): every line is still
    # the text format (a bad one makes Prometheus refuse the whole scrape),
    # the label says the name escaped; with --replicas 2 both meshes have
    # their series from the first scrape; IPv6 reaches the port too.
    odd = b'my "odd"\\ model\n\xff'
    d = Daemon("--metrics-port", "0", "--replicas", "2", "--threads", "1",
               "--model-name", odd.decode("utf-8", "surrogateescape"), wait_serving=False)
    try:
        port = int(d.metrics_url.rsplit(":", 1)[1].split("/")[0])
        sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*'
                            r'(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
                            r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*\})? \S+$')
        hosts = ["127.0.0.1"]
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
            hosts.append("[::1]")
        except OSError:
            print("  no IPv6 loopback here: IPv4 only")
        for host in hosts:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            bad = [l for l in text.splitlines() if l and not l.startswith("#")
                   and not sample.match(l)]
            assert not bad, bad[:3]
            want = 'model="my \\"odd\\"\\\\ model\\n?"'
            assert want in text, text[:400]
            for mesh in ("0", "1"):
                assert re.search(f'ditserve_mesh_state{{.*mesh="{mesh}"', text), (mesh, text)
        d.wait_serving(60)
        d.stop()
    finally:
        d.close()


@case
def join():
    """A mesh across "hosts" over TCP loopback: rank 0 started by ditd, rank 1
    a `ditworker --join` with the shared secret. Wrong secrets, ranks the
    mesh lacks and garbage on the join port are refused while the daemon
    keeps going; the image equals ditrun's; when the local worker dies the
    joined one rejoins by itself; when the joined one dies the in-flight
    request fails naming rank 1 and a new joiner restores the mesh; on
    SIGTERM a --once joiner exits 0."""
    H = "grpc.health.v1.HealthCheckResponse.ServingStatus"
    worker = env_path("DITWORKER")
    joiners = []
    # The flags are documented, and a half-configured multi-node start is refused.
    h = subprocess.run([worker, "--help"], capture_output=True, text=True, timeout=10)
    assert h.returncode == 0 and "--join HOST:PORT" in h.stdout and "DITWORKER_SECRET_FILE" in h.stdout
    h = subprocess.run([env_path("DITD"), "--help"], capture_output=True, text=True, timeout=10)
    assert h.returncode == 0 and "--join-listen" in h.stdout and "DITD_LOCAL_RANKS" in h.stdout
    bad = subprocess.run([env_path("DITD"), "--model", DEMO, "--world-size", "2", "--ring", "2",
                          "--local-ranks", "1"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "--join-listen" in bad.stderr, bad.stderr
    bad = subprocess.run([worker, "--join", "127.0.0.1:1"], capture_output=True, text=True,
                         timeout=10)
    assert bad.returncode == 2 and "--secret-file" in bad.stderr, bad.stderr
    with tempfile.TemporaryDirectory() as tmp:
        def secret_file(name, text):
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write(text)
            return path

        secret = secret_file("secret", "7f3a9c0e5b2d48e1a6c4f0b9d3e7a215\n")
        wrong = secret_file("wrong", "00000000000000000000000000000000\n")
        short = secret_file("short", "tiny\n")
        # An address that is not HOST:PORT is the worker's own mistake: it
        # exits at once instead of retrying.
        bad = subprocess.run([worker, "--join", "127.0.0.1", "--secret-file", secret],
                             capture_output=True, text=True, timeout=10)
        assert bad.returncode == 2 and "HOST:PORT" in bad.stderr, (bad.returncode, bad.stderr)
        d = Daemon("--ring", "2", "--local-ranks", "1", "--join-listen", "127.0.0.1:0",
                   "--join-secret-file", secret, world=2, wait_serving=False)
        try:
            api = d.api
            assert d.join_target, "no join address"
            assert d.health() == api.enum(H, "NOT_SERVING")
            wait_for(lambda: d.info().mesh_state == "starting", 10, "mesh starting")

            def join_once(*extra, timeout=30):
                return subprocess.run([worker, "--join", d.join_target, "--once"] + list(extra),
                                      capture_output=True, timeout=timeout)

            # A wrong secret: the daemon refuses before it has proved the
            # secret, so the worker cannot tell its refusal from a forged
            # one and keeps trying (saying why each time) instead of exiting.
            wp = subprocess.Popen([worker, "--join", d.join_target, "--once", "--secret-file",
                                   wrong], stderr=subprocess.PIPE)
            wait_for(lambda: d.log().count("wrong secret") >= 2, 30, "a second wrong-secret try")
            assert wp.poll() is None, "the worker gave up on an unproved refusal"
            wp.kill()
            err = wp.communicate()[1].decode()
            assert "wrong secret" in err and "not for good" in err, err
            assert "refused the worker" in d.log()
            # A rank the mesh lacks: refused after the daemon's proof, for good.
            r = join_once("--secret-file", secret, "--rank", "5")
            err = r.stderr.decode()
            assert r.returncode == 3 and "not a remote rank" in err, (r.returncode, err)
            r = join_once("--secret-file", short)
            err = r.stderr.decode()
            assert r.returncode == 2 and "at least 16" in err, (r.returncode, err)
            # Garbage instead of a join request: closed, nothing else happens.
            import socket
            host, port = d.join_target.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as sk:
                sk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
                got = b""
                while True:
                    chunk = sk.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            assert d.health() == api.enum(H, "NOT_SERVING")
            # Idle connections: at most 32 handshakes at a time; each new one
            # past that closes the oldest, so a real worker gets in past
            # idle sockets (a fast enough flood of new ones still would not
            # let it: README, Deployment).
            socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
            # Every connection gets its challenge (the first eight before
            # they are closed), so all 40 are accepted by now.
            for i, sk in enumerate(socks):
                assert sk.recv(4096), f"connection {i} got no challenge"

            def at_eof(sk, timeout_s):
                """Whether the daemon closed sk (within timeout_s)."""
                sk.settimeout(timeout_s)
                try:
                    while sk.recv(4096):
                        pass
                    return True
                except socket.timeout:
                    return False
            # The oldest eight are closed; the rest stay open.
            closed = [i for i, sk in enumerate(socks) if at_eof(sk, 10 if i < 8 else 0.01)]
            for sk in socks:
                sk.close()
            assert closed == list(range(8)), closed
            assert "handshakes in progress; closed the oldest" in d.log()

            logf = open(os.path.join(tmp, "joiner.log"), "w")
            j1 = subprocess.Popen([worker, "--join", d.join_target, "--secret-file", secret],
                                  stderr=logf)
            joiners.append(j1)
            d.wait_serving(60)
            info = d.info()
            assert info.world_size == 2 and info.mesh_state == "ready", info
            _, png, res = d.generate(seed=7, **SMALL)
            ref = ditrun_png(tmp, seed=7, **SMALL)
            assert png == ref, "the joined mesh's PNG differs from ditrun generate's"

            # The local worker dies: the mesh is rebuilt and the joined worker
            # comes back by itself.
            local = children_of(d.proc.pid)
            assert len(local) == 1, local
            os.kill(local[0], signal.SIGKILL)
            wait_for(lambda: d.info().worker_restarts == 1, 30, "restart")
            d.wait_serving(60)
            assert j1.poll() is None, "the joined worker exited instead of rejoining"
            _, png2, _ = d.generate(seed=7, **SMALL)
            assert png2 == ref

            # The joined worker dies mid-request: UNAVAILABLE naming rank 1, and
            # the mesh waits for a new joiner.
            call = api.generate(d.channel)(api.request(seed=1, **LONG), timeout=600)
            wait_progress(call)
            j1.kill()
            j1.wait()
            expect_error(lambda: ditapi.collect(call), "UNAVAILABLE", "rank 1")
            wait_for(lambda: d.info().mesh_state == "starting", 30, "mesh waiting for rank 1")
            assert d.health() == api.enum(H, "NOT_SERVING")
            j2 = subprocess.Popen([worker, "--join", d.join_target, "--secret-file", secret,
                                   "--once", "--rank", "1"], stderr=logf)
            joiners.append(j2)
            d.wait_serving(60)
            _, png3, _ = d.generate(seed=7, **SMALL)
            assert png3 == ref
            d.stop()
            assert j2.wait(30) == 0, "the --once joiner did not exit cleanly on shutdown"
            logf.close()
        except BaseException:
            jlog = os.path.join(tmp, "joiner.log")
            if os.path.exists(jlog):
                with open(jlog, errors="replace") as f:
                    print("----- joined workers\n" + f.read(), file=sys.stderr)
            raise
        finally:
            for j in joiners:
                if j.poll() is None:
                    j.kill()
                    j.wait()
            d.close()


@case
def join_gathering():
    """A joined worker that leaves while the mesh still waits for another
    rank frees its rank: the local worker is not restarted and the mesh
    starts once two joiners are there. (Before, the whole mesh was torn
    down and started again, with doubled back-off on every side.)"""
    worker = env_path("DITWORKER")
    joiners = []
    with tempfile.TemporaryDirectory() as tmp:
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("7f3a9c0e5b2d48e1a6c4f0b9d3e7a215\n")
        d = Daemon("--ring", "4", "--local-ranks", "2", "--threads", "1", "--join-listen",
                   "127.0.0.1:0", "--join-secret-file", secret, world=4, wait_serving=False)

        def join():
            p = subprocess.Popen([worker, "--join", d.join_target, "--secret-file", secret],
                                 stderr=subprocess.DEVNULL)
            joiners.append(p)
            return p
        try:
            wait_for(lambda: d.join_target, 30, "the join port")
            local = children_of(d.proc.pid)
            assert len(local) == 2, local
            first = join()
            wait_for(lambda: re.search(r"rank \d: the worker at", d.log()), 30, "the first join")
            first.kill()
            first.wait(10)
            wait_for(lambda: "left before the mesh started" in d.log(), 30, "the rank freed")
            assert "tearing the mesh down" not in d.log(), d.log()
            assert children_of(d.proc.pid) == local, "the local worker was restarted"
            join()
            join()
            d.wait_serving(120)
            info = d.info()
            assert info.mesh_state == "ready" and info.worker_restarts == 0, info
            assert children_of(d.proc.pid) == local
            _, png, _ = d.generate(seed=7, **SMALL)
            assert png.startswith(PNG_MAGIC)
            d.stop()
        finally:
            for p in joiners:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            d.close()


@case
def cfg_parallel():
    """ditd --cfg-parallel on 2 workers: GetServerInfo reports cfg_degree 2,
    and a true-CFG request gives ditrun's PNG on the same layout."""
    d = Daemon("--cfg-parallel", world=2)
    try:
        info = d.info()
        assert info.world_size == 2 and info.layout.cfg_degree == 2, info
        gen = dict(SMALL, seed=5, negative_prompt="blurry", true_cfg_scale=3.0)
        _, png, res = d.generate(**gen)
        assert png.startswith(PNG_MAGIC) and not res.warnings, res
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ditrun.png")
            cmd = [env_path("DITRUN"), "generate", "--model", DEMO, "--prompt", gen["prompt"],
                   "--negative-prompt", "blurry", "--true-cfg", "3",
                   "--width", str(gen["width"]), "--height", str(gen["height"]),
                   "--steps", str(gen["num_inference_steps"]), "--seed", "5",
                   "--world-size", "2", "--cfg-parallel", "--output", out]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out, "rb") as f:
                ref = f.read()
        assert png == ref, "the daemon's PNG differs from ditrun generate --cfg-parallel's"
        assert d.info().worker_restarts == 0
        d.stop()
    finally:
        d.close()


def embeddings(*shape, phase=0.0):
    """An f32 tensor of smooth values in -1 .. 1, for requests' embeddings."""
    n = math.prod(shape)
    vals = [math.sin(0.37 * i + phase) for i in range(n)]
    return ("DTYPE_F32", list(shape), struct.pack(f"<{n}f", *vals))


@case
def own_embeddings():
    """A pipeline folder without text encoders serves requests that bring
    their embeddings, FLUX.1 and Wan 2.1 alike: the same raw result, bit for
    bit, as the whole pipeline given the same embeddings, and batched with
    another such request within 1e-5 of it (a batch's GEMMs round
    differently). A request without them is refused, and the daemon goes
    on."""
    raw = "OUTPUT_FORMAT_RAW_TENSOR"
    flux = dict(width=64, height=64, num_inference_steps=2, seed=4, output_format=raw,
                prompt_embeds=embeddings(1, 8, 32), pooled_prompt_embeds=embeddings(1, 32))
    wan = dict(width=32, height=32, num_frames=5, num_inference_steps=2, seed=4,
               guidance_scale=1.0, output_format=raw, prompt_embeds=embeddings(1, 8, 32))
    with tempfile.TemporaryDirectory() as tmp:
        for name, src, req in (("flux", DEMO, flux), ("wan", WAN_DEMO, wan)):
            bare = os.path.join(tmp, name)
            without_text_encoders(bare, src)
            want = {}
            for model in (src, bare):
                d = Daemon("--max-batch", "2", model=model)
                try:
                    ms = d.api.list_models(d.channel)(
                        d.api.msg("ditserve.v1.ListModelsRequest")(), timeout=10).models
                    assert ms[0].has_text_encoders == (model == src), ms[0]
                    _, data, _ = d.generate(**req)
                    if model == src:
                        want = data
                    else:
                        assert data == want, f"{name}: the bare pipeline's result differs"
                        expect_error(lambda: d.generate(prompt="x", width=64, height=64),
                                     "INVALID_ARGUMENT", "no text encoder")
                        # Two at once, batched, each still its own.
                        blocker = d.api.generate(d.channel)(
                            d.api.request(**dict(req, num_inference_steps=1000)), timeout=600)
                        wait_progress(blocker)
                        calls = [d.api.generate(d.channel)(d.api.request(**req), timeout=300)
                                 for _ in range(2)]
                        t0 = time.monotonic()
                        while d.info().queue_depth < 2 and time.monotonic() - t0 < 10:
                            time.sleep(0.01)
                        blocker.cancel()
                        for c in calls:
                            images, res = ditapi.collect_images(c)
                            assert res.batch_size == 2, res
                            assert len(images[0]) == len(want), (len(images[0]), len(want))
                            got, ref = (struct.unpack(f"<{len(x) // 4}f", x)
                                        for x in (images[0], want))
                            top = max(abs(v) for v in ref)
                            assert top > 1e-3, "an empty image"
                            rel = max(abs(a - b) for a, b in zip(got, ref)) / top
                            assert rel <= 1e-5, f"{name}: batched {rel:.3g} from alone"
                        assert d.info().worker_restarts == 0
                    d.stop()
                finally:
                    d.close()
            print(f"  {name}: the bare pipeline gives the whole pipeline's result")


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
