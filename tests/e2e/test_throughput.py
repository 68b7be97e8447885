"""End-to-end tests of ditd's throughput features: batched requests
(--max-batch), several meshes (--replicas), and what ServerInfo and the
metrics say about them. The real daemon, real workers, real gRPC.

    test_throughput.py CASE      runs one case (meson registers each as a test)
    test_throughput.py --list    lists the cases
"""

import json
import math
import os
import re
import signal
import struct
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import alive, children_of, Daemon, DEMO, generate_queued, run_cases  # noqa: E402
from daemon import without_text_encoders  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(prompt="a red fox in the snow", width=64, height=64, num_inference_steps=4)
RAW = "OUTPUT_FORMAT_RAW_TENSOR"
# Holds a mesh until cancelled (25 ms a step on one core: 25 s and more).
LONG = dict(prompt="a very long job", width=512, height=512, num_inference_steps=1000)
# The batch members: each its own prompt, seed, guidance and image count.
MEMBERS = [
    dict(prompt="a red fox in the snow", seed=11, guidance_scale=3.5),
    dict(prompt="a lighthouse at dusk, oil on canvas", seed=12, guidance_scale=1.5),
    dict(prompt="", seed=13, guidance_scale=6.0, num_images=2),
]
# The 40-step shape the batch tests use; 96x64 is a different shape.
SHAPE = dict(width=64, height=64, num_inference_steps=40)

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def expect_code(fn, code):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code().name == code, f"got {e.code().name} ({e.details()!r}), expected {code}"
        return e.details() or ""
    raise AssertionError(f"expected {code}, the call succeeded")


def wait_progress(call):
    for ev in call:
        if ev.WhichOneof("event") == "progress":
            return ev
    raise AssertionError("the stream ended before any progress")


def floats(raw):
    return struct.unpack(f"<{len(raw) // 4}f", raw)


def assert_close(got, want, what, rel=1e-5):
    """Raw f32 tensors equal within `rel` of the largest magnitude."""
    a, b = floats(got), floats(want)
    assert len(a) == len(b), f"{what}: {len(a)} values, expected {len(b)}"
    scale = max(abs(x) for x in b)
    assert scale > 1e-3, f"{what}: the reference is empty (max |x| {scale:.3g})"
    worst = max(abs(x - y) for x, y in zip(a, b)) / scale
    assert worst <= rel, f"{what}: differs by {worst:.3g} relative (tolerance {rel})"
    return worst


def scraper(d):
    url = d.metrics_url

    def scrape():
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out = {}
        for l in text.splitlines():
            if l and not l.startswith("#"):
                name, value = l.rsplit(" ", 1)
                out[name] = float(value)
        return out
    return scrape


def mesh_pids(d):
    """{mesh name: [pid of rank 0, rank 1, ...]} from the start-up log lines,
    the newest start of each mesh."""
    pids = {}
    for m in re.finditer(r"(mesh\d*)\S*\s.*?started \d+ worker\(s\) \(pids ([\d ]+)\)", d.log()):
        pids[m.group(1)] = [int(p) for p in m.group(2).split()]
    return pids


def wait_meshes_ready(d, timeout_s=60):
    """Health turns SERVING with the first mesh; this waits for all."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        info = d.info()
        if all(m.state == "ready" for m in info.meshes):
            return info
        time.sleep(0.05)
    raise AssertionError(f"the meshes are not all ready: {d.info()}")


def start_blocker(d):
    """A LONG request holding the (only) mesh, so that what follows queues."""
    call = d.api.generate(d.channel)(d.api.request(seed=1, **LONG), timeout=600)
    wait_progress(call)
    return call


def solo_results(d, members, **shape):
    """Each member's raw images, run alone (one at a time)."""
    out = []
    for m in members:
        call = d.api.generate(d.channel)(
            d.api.request(output_format=RAW, **dict(shape, **m)), timeout=300)
        out.append(ditapi.collect_images(call)[0])
    return out


def run_concurrently(d, reqs, timeout=300):
    """Starts every request in order (each queued before the next starts);
    returns {index: (kinds, raw, res) or the RpcError} (filled as the
    threads end: join_all checks they all did) and the threads."""
    results, threads = {}, []

    def one(k, call):
        try:
            results[k] = ditapi.collect_images(call)
        except grpc.RpcError as e:
            results[k] = e

    for k, fields in enumerate(reqs):
        before = d.info().queue_depth
        call = d.api.generate(d.channel)(d.api.request(**fields), timeout=timeout)
        t = threading.Thread(target=one, args=(k, call))
        t.start()
        threads.append(t)
        t0 = time.monotonic()
        while d.info().queue_depth <= before and time.monotonic() - t0 < 10:
            time.sleep(0.01)
    return results, threads


def join_all(results, threads, n, timeout=300):
    """Waits for run_concurrently's threads; every one of the n requests
    must have ended with a result or an error (none silently missing)."""
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a request is still running"
    assert sorted(results) == list(range(n)), sorted(results)


def wide_text_pipeline(root, joint):
    """The demo pipeline without its text encoders and with a text width
    (joint_attention_dim) of `joint`: its context embedder (the only weight
    that sees the width) gets small deterministic values. Requests bring
    prompt_embeds of shape (1, L, joint)."""
    without_text_encoders(root, DEMO)
    os.unlink(os.path.join(root, "transformer"))
    os.makedirs(os.path.join(root, "transformer"))
    demo = DEMO
    with open(os.path.join(demo, "transformer", "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    cfg["joint_attention_dim"] = joint
    with open(os.path.join(root, "transformer", "config.json"), "w") as f:
        json.dump(cfg, f)
    src = os.path.join(demo, "transformer", "diffusion_pytorch_model.safetensors")
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, meta in header.items():
        if name != "__metadata__":
            a, b = meta["data_offsets"]
            tensors[name] = (meta["dtype"], meta["shape"], data[a:b])
    scale = 1.0 / math.sqrt(joint)
    w = [scale * (((i * 7919) % 2003) / 1001.0 - 1.0) for i in range(hidden * joint)]
    tensors["context_embedder.weight"] = ("F32", [hidden, joint], struct.pack(f"<{len(w)}f", *w))
    out, blobs, off = {"__metadata__": header.get("__metadata__", {})}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    head = json.dumps(out).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(root, "transformer", "diffusion_pytorch_model.safetensors"),
              "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


# --------------------------------------------------------------------------


@case
def batch_results():
    """Three queued requests of one shape (own prompts, seeds, guidance, one
    with two images) run as one batch on a ring-2 mesh; each result equals
    the same request run alone within 1e-5; the batch size histogram and
    ServerInfo show one generation of three requests."""
    d = Daemon("--ring", "2", "--max-batch", "4", "--metrics-port", "0", world=2)
    try:
        scrape = scraper(d)
        solo = solo_results(d, MEMBERS, **SHAPE)
        info0 = d.info()
        assert info0.max_batch == 4, info0
        jobs0 = info0.meshes[0].jobs
        blocker = start_blocker(d)
        reqs = [dict(SHAPE, output_format=RAW, **m) for m in MEMBERS]
        results, threads = run_concurrently(d, reqs)
        assert d.info().queue_depth == 3
        blocker.cancel()
        join_all(results, threads, len(reqs))
        worst = 0.0
        for k, r in results.items():
            assert not isinstance(r, Exception), f"member {k} failed: {r}"
            images, res = r
            assert res.seed == MEMBERS[k]["seed"], res
            # It ran with two others and waited for their own stages too.
            assert res.batch_size == 3 and res.timings.batch_others_ms > 0, res
            assert len(images) == len(solo[k]), (k, len(images))
            for i, img in enumerate(images):
                worst = max(worst, assert_close(img, solo[k][i], f"member {k} image {i}"))
        print(f"  batched vs alone: worst relative difference {worst:.3g}")
        info = d.info()
        # The blocker, then the three members as one generation.
        assert info.meshes[0].jobs - jobs0 == 2, info.meshes[0]
        # Three solo runs and the blocker alone, then the batch of three.
        m = scrape()
        assert m['ditserve_batch_size_bucket{model="demo",le="1"}'] == 4, m
        assert m['ditserve_batch_size_bucket{model="demo",le="2"}'] == 4, m
        assert m['ditserve_batch_size_bucket{model="demo",le="3"}'] == 5, m
        assert m['ditserve_batch_size_count{model="demo"}'] == 5, m
        assert m['ditserve_batch_size_sum{model="demo"}'] == 7, m
        d.stop()
    finally:
        d.close()


@case
def batch_spread_layouts():
    """With --max-batch above 1 every rank decodes its share of a batch: on
    Ulysses 2 and, with true CFG, on --cfg-parallel, three queued members
    run as one generation and give each its result run alone within 1e-5,
    whichever rank decoded it (which rank that is, worker_spreads_decodes
    checks on the workers' own messages)."""
    cfg = [dict(m, negative_prompt="blurry", true_cfg_scale=2.0 + k)
           for k, m in enumerate(MEMBERS)]
    for flags, members in ((("--ulysses", "2"), MEMBERS), (("--cfg-parallel",), cfg)):
        d = Daemon(*flags, "--max-batch", "4", world=2)
        try:
            shape = dict(SHAPE, num_inference_steps=8)
            solo = solo_results(d, members, **shape)
            blocker = start_blocker(d)
            reqs = [dict(shape, output_format=RAW, **m) for m in members]
            jobs0 = d.info().meshes[0].jobs
            results, threads = run_concurrently(d, reqs)
            assert d.info().queue_depth == 3
            blocker.cancel()
            join_all(results, threads, len(reqs))
            # The blocker, then the three as one generation.
            assert d.info().meshes[0].jobs - jobs0 == 2, d.info().meshes[0]
            worst = 0.0
            for k, r in results.items():
                assert not isinstance(r, Exception), f"{flags}: member {k} failed: {r}"
                images, res = r
                assert res.batch_size == 3, res
                assert len(images) == len(solo[k]), (k, len(images))
                for i, img in enumerate(images):
                    what = f"{flags} member {k} image {i}"
                    worst = max(worst, assert_close(img, solo[k][i], what))
            print(f"  {' '.join(flags)}: batched vs alone: worst relative difference {worst:.3g}")
            d.stop()
        finally:
            d.close()


@case
def images_spread_over_ranks():
    """One request of three images on a ring-2 mesh: its images are decoded
    on both ranks and ditd puts them back in order: each equals the same
    image from a one-rank daemon within 1e-5 (and differs from the others:
    the order is checked), as raw tensors, and its PNG is that image
    quantised (within one 8-bit step)."""
    shape = dict(SHAPE, num_inference_steps=8)
    req = dict(shape, prompt="a paper boat on a pond", seed=21, num_images=3)
    want = {}
    for world, flags in ((1, ()), (2, ("--ring", "2"))):
        d = Daemon(*flags, world=world)
        try:
            for fmt in (RAW, "OUTPUT_FORMAT_PNG"):
                call = d.api.generate(d.channel)(d.api.request(output_format=fmt, **req),
                                                 timeout=300)
                images, res = ditapi.collect_images(call)
                assert len(images) == 3 and len(res.image_bytes) == 3, res
                assert res.timings.vae_ms > 0, res.timings
                if fmt != RAW:
                    # Each PNG is the one-rank daemon's image i, in order.
                    for i, img in enumerate(images):
                        off = ditapi.png_matches_raw(img, want[i], shape["width"],
                                                     shape["height"])
                        assert off <= 1, f"PNG {i} is {off} steps from image {i}"
                    continue
                if world == 1:
                    want = images
                    continue
                worst = 0.0
                for i, img in enumerate(images):
                    worst = max(worst, assert_close(img, want[i], f"image {i}"))
                    for j in range(3):
                        if j != i:
                            a, b = floats(img), floats(want[j])
                            far = max(abs(x - y) for x, y in zip(a, b))
                            assert far > 1e-2, f"image {i} is image {j} of the one-rank daemon"
                print(f"  ring 2, images decoded on both ranks vs one rank: worst {worst:.3g}")
            d.stop()
        finally:
            d.close()


@case
def batch_cancel_deadline():
    """In a running batch of three, one member's client cancels and one
    member's deadline passes: those two end (CANCELLED, DEADLINE_EXCEEDED)
    while the batch goes on, and the third's result equals it run alone."""
    d = Daemon("--max-batch", "4", world=1)
    try:
        # The deadline passes mid-run (a member that finished first would
        # fail the test): it is scaled by this machine's speed, 0.8 times a
        # solo run of one image, where the batch has four (measured here:
        # the batch takes 1.8 times the solo run).
        shape = dict(width=128, height=128, num_inference_steps=300)
        t0 = time.monotonic()
        solo = solo_results(d, MEMBERS[:1], **shape)
        solo_s = time.monotonic() - t0
        deadline_s = max(1.0, 0.8 * solo_s)
        print(f"  solo: {solo_s:.1f} s; the deadline: {deadline_s:.1f} s")
        blocker = start_blocker(d)
        api = d.api
        calls = [api.generate(d.channel)(api.request(output_format=RAW, **dict(shape, **m)),
                                         timeout=t)
                 for m, t in zip(MEMBERS, (300, 300, deadline_s))]
        t0 = time.monotonic()
        while d.info().queue_depth < 3 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert d.info().queue_depth == 3, d.info()
        jobs0 = d.info().meshes[0].jobs
        blocker.cancel()
        wait_progress(calls[1])
        assert d.info().meshes[0].running == 3, d.info()
        calls[1].cancel()
        expect_code(lambda: ditapi.collect(calls[1]), "CANCELLED")
        expect_code(lambda: ditapi.collect(calls[2]), "DEADLINE_EXCEEDED")
        # The first member still runs after both left.
        left = time.monotonic()
        images, res = ditapi.collect_images(calls[0])
        print(f"  the batch ran on {time.monotonic() - left:.1f} s after both left")
        # The batch went on (not a rerun alone): the blocker, then one
        # generation of three.
        assert res.batch_size == 3, res
        assert d.info().meshes[0].jobs - jobs0 == 2, d.info().meshes[0]
        worst = assert_close(images[0], solo[0][0], "the remaining member")
        print(f"  the member that stayed: {worst:.3g} from its solo result")
        d.wait_idle(30)
        # The request log says how each ended, as its client heard it.
        log = d.log()
        assert re.search(r"shape=128x128 steps=300 .*status=DEADLINE_EXCEEDED detail=the "
                         r"call's deadline passed", log), log
        assert re.search(r"shape=128x128 steps=300 .*status=CANCELLED detail=the client "
                         r"cancelled", log), log
        d.stop()
    finally:
        d.close()


@case
def cancel_while_decoding():
    """A member of a batch whose client cancels after the last step (while
    the VAE decodes) hears CANCELLED, and the request log and metrics say
    CANCELLED too, not OK, though the workers finished it; the other
    member's result arrives."""
    d = Daemon("--max-batch", "2", "--metrics-port", "0", world=1)
    try:
        scrape = scraper(d)
        blocker = start_blocker(d)
        # 1024x1024: the decodes and PNGs take a few hundred ms, room for the
        # cancel to arrive while they run even on a loaded machine.
        shape = dict(prompt="a harbour", width=1024, height=1024, num_inference_steps=1)
        calls = [d.api.generate(d.channel)(d.api.request(seed=s, **shape), timeout=300)
                 for s in (1, 2)]
        t0 = time.monotonic()
        while d.info().queue_depth < 2 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        blocker.cancel()
        for ev in calls[0]:
            if ev.WhichOneof("event") == "progress" and ev.progress.stage == "decoding":
                break
        calls[0].cancel()
        expect_code(lambda: ditapi.collect(calls[0]), "CANCELLED")
        _, png, res = ditapi.collect(calls[1])
        assert png.startswith(PNG_MAGIC) and res.batch_size == 2, res
        d.wait_idle(30)
        m = scrape()
        ok = m.get('ditserve_requests_total{model="demo",status="OK"}', 0)
        cancelled = m.get('ditserve_requests_total{model="demo",status="CANCELLED"}', 0)
        # The blocker and the cancelled member; the other member is the one OK.
        assert (ok, cancelled) == (1, 2), m
        assert re.search(r"shape=1024x1024 steps=1 .*status=CANCELLED", d.log()), d.log()
        d.stop()
    finally:
        d.close()


@case
def batch_priority():
    """Priorities with batching: the head of the queue is the most urgent
    request, and a request joins a batch only if that overtakes nothing more
    urgent. Queue: A (priority 5, shape X), B (3, shape Y), C (1, shape X),
    D (5, shape X): A and D run together, then B, then C alone."""
    d = Daemon("--max-batch", "4", world=1)
    try:
        blocker = start_blocker(d)
        X = dict(SMALL, num_inference_steps=8)
        Y = dict(SMALL, width=96, num_inference_steps=8)
        reqs = [dict(X, seed=1, priority=5, request_id="A"),
                dict(Y, seed=2, priority=3, request_id="B"),
                dict(X, seed=3, priority=1, request_id="C"),
                dict(X, seed=4, priority=5, request_id="D")]
        # Each start is placed on the client's clock from the server's own
        # figure, Started.queue_ms (start - arrival, on the server), and the
        # arrival's bounds: after the call was made, before the queue showed
        # it. Client threads' reading times are not used: on a loaded
        # machine a thread can read its Started long after it came.
        queue_ms, sizes, sent, seen = {}, {}, {}, {}

        def one(k, call):
            for ev in call:
                if ev.WhichOneof("event") == "started":
                    queue_ms[k] = ev.started.queue_ms
                if ev.WhichOneof("event") == "result":
                    sizes[k] = ev.result.batch_size
        threads = []
        for k, fields in enumerate(reqs):
            sent[k] = time.monotonic()
            call = d.api.generate(d.channel)(d.api.request(**fields), timeout=300)
            t = threading.Thread(target=one, args=(k, call))
            t.start()
            threads.append(t)
            while d.info().queue_depth < k + 1 and time.monotonic() - sent[k] < 10:
                time.sleep(0.01)
            seen[k] = time.monotonic()
        assert d.info().queue_depth == 4, d.info()
        jobs0 = d.info().meshes[0].jobs
        blocker.cancel()
        for t in threads:
            t.join(300)
        assert sorted(queue_ms) == [0, 1, 2, 3], queue_ms
        # A and D in one generation, B and C each alone.
        assert sizes == {0: 2, 1: 1, 2: 1, 3: 2}, sizes
        # Bounds of each start, with 5 ms for the two clocks' rates.
        lo = {k: sent[k] + queue_ms[k] / 1e3 - 0.005 for k in range(4)}
        hi = {k: seen[k] + queue_ms[k] / 1e3 + 0.005 for k in range(4)}
        assert max(lo[0], lo[3]) <= min(hi[0], hi[3]), f"A and D did not start together ({lo}, {hi})"
        # The order the jobs ran in, from ditd's request log.
        ran = d.finished({"A", "B", "C", "D"})
        assert sorted(ran[:2]) == ["A", "D"] and ran[2:] == ["B", "C"], ran
        # The blocker, A+D, B, C.
        assert d.info().meshes[0].jobs - jobs0 == 4, d.info().meshes[0]
        d.stop()
    finally:
        d.close()


def send_spaced(d, reqs, gap_s, collect):
    """Sends the requests gap_s apart, each read by collect on a thread of
    its own; returns {index: what collect returned} once all are done."""
    results, threads = {}, []
    for k, fields in enumerate(reqs):
        call = d.api.generate(d.channel)(d.api.request(**fields), timeout=120)
        t = threading.Thread(target=lambda k=k, c=call: results.__setitem__(k, collect(c)))
        t.start()
        threads.append(t)
        time.sleep(gap_s)
    for t in threads:
        t.join(120)
    return results


@case
def batch_wait():
    """--batch-wait-ms: an idle mesh holds the first request briefly and the
    second, sent within that time, joins its batch."""
    d = Daemon("--max-batch", "4", "--batch-wait-ms", "1500", world=1)
    try:
        jobs0 = d.info().meshes[0].jobs
        results = send_spaced(d, [dict(SMALL, seed=1), dict(SMALL, seed=2)], 0.2, ditapi.collect)
        assert all(results[k][1].startswith(PNG_MAGIC) for k in range(2))
        info = d.info().meshes[0]
        assert info.jobs - jobs0 == 1 and info.requests >= 2, info
        d.stop()
    finally:
        d.close()
    # A batch that is full before --max-batch (16 images: two requests of
    # 8) runs at once instead of waiting out the window for company that
    # could not join.
    d = Daemon("--max-batch", "4", "--batch-wait-ms", "6000", world=1)
    try:
        eight = dict(SMALL, width=32, height=32, num_inference_steps=1, num_images=8)
        results = send_spaced(d, [dict(eight, seed=1), dict(eight, seed=2)], 0.3,
                              ditapi.collect_images)
        for k in range(2):
            images, res = results[k]
            assert len(images) == 8 and res.batch_size == 2, res
        # The first request's wait, as ditd measured it: the 0.3 s until
        # the second came, not the 6 s window.
        waited = results[0][1].timings.queue_ms
        print(f"  a full batch of 16 images ran after {waited:.0f} ms")
        assert waited < 3000, f"the full batch waited: {waited:.0f} ms"
        d.stop()
    finally:
        d.close()


@case
def batch_wait_bounds():
    """--batch-wait-ms holds a batch open for company at most that long
    after the oldest waiting request came, and never past a member's
    deadline: a request whose deadline is nearer than the window runs at
    once; a more urgent request that comes later (and cannot join) does
    not restart the clock for the one already waiting."""
    d = Daemon("--max-batch", "4", "--batch-wait-ms", "3000", world=1)
    try:
        # Alone, with a 2.5 s deadline against the 3 s window: it runs.
        kinds, png, res = d.generate(timeout=2.5, seed=1, **SMALL)
        assert kinds[-1] == "result" and png.startswith(PNG_MAGIC), kinds
        print(f"  a request with a deadline inside the window waited "
              f"{res.timings.queue_ms:.0f} ms")
        assert res.timings.queue_ms < 1000, res.timings
        # A waits for company; a second later U (more urgent, another
        # shape, so not A's company) comes. The mesh runs U when A has
        # waited 3 s, about 2 s after U came, not 3 s after.
        a, a_out = generate_queued(d, seed=2, request_id="A", **SMALL)
        time.sleep(1.0)
        u, u_out = generate_queued(d, seed=3, priority=5, request_id="U",
                                   **dict(SMALL, width=96))
        for t in (a, u):
            t.join(60)
        for out in (a_out, u_out):
            assert not isinstance(out["r"], grpc.RpcError), out["r"]
        u_wait = u_out["r"][2].timings.queue_ms
        a_wait = a_out["r"][2].timings.queue_ms
        print(f"  U came 1 s after A and waited {u_wait:.0f} ms; A waited {a_wait:.0f} ms")
        assert u_wait < 2600, f"U waited its own 3 s window ({u_wait:.0f} ms)"
        ran = d.finished({"A", "U"})
        assert ran == ["U", "A"], ran
        d.stop()
    finally:
        d.close()


@case
def batch_message_budget():
    """A batch's requests go to the workers in one message of at most 512
    MiB. Three queued requests of one shape, each with 192 MiB of
    prompt_embeds (1024 tokens 49152 wide), on --max-batch 16: they run as
    a batch of two and one of one, each within the message, and the mesh
    never fails. (As one batch of 576 MiB the job could not be sent: the
    mesh was torn down and all three failed UNAVAILABLE.)"""
    joint, tokens = 49152, 1024
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "wide")
        wide_text_pipeline(model, joint)
        d = Daemon("--max-batch", "16", "--max-message-bytes", str(200 << 20), world=1,
                   model=model)
        try:
            def embeds(n):
                return dict(prompt_embeds=("DTYPE_F32", [1, n, joint], bytes(4 * n * joint)),
                            pooled_prompt_embeds=("DTYPE_F32", [1, 32], bytes(4 * 32)))
            jobs0 = d.info().meshes[0].jobs
            # The blocker's text is shorter: it batches with none of them.
            call = d.api.generate(d.channel)(
                d.api.request(seed=1, **dict(LONG, prompt="", **embeds(8))), timeout=600)
            wait_progress(call)
            big = embeds(tokens)
            reqs = [dict(width=64, height=64, num_inference_steps=1, seed=20 + k, **big)
                    for k in range(3)]
            results, threads = run_concurrently(d, reqs)
            assert d.info().queue_depth == 3
            call.cancel()
            for t in threads:
                t.join(300)
            sizes = []
            for k in range(3):
                r = results[k]
                assert not isinstance(r, Exception), f"request {k} failed: {r}"
                images, res = r
                assert images[0].startswith(PNG_MAGIC) and res.seed == 20 + k, res
                sizes.append(res.batch_size)
            assert sorted(sizes) == [1, 2, 2], sizes
            info = d.info()
            assert info.worker_restarts == 0 and info.meshes[0].worker_restarts == 0, info
            # The blocker, then the two batches.
            assert info.meshes[0].jobs - jobs0 == 3, info.meshes[0]
            print(f"  three 192 MiB requests ran in batches of {sorted(set(sizes))[::-1]}")
            d.stop()
        finally:
            d.close()


@case
def batch_unread_room():
    """Batched members whose results finish together on one connection do
    not count against each other in --max-unread-bytes: two raw 256x256
    results (768 KiB each) of one batch, on one connection with a 512 KiB
    bound, both reach the client that reads them. (Judged member by member,
    the second saw the first's bytes queued that instant and was dropped
    with RESOURCE_EXHAUSTED; the bound itself: e2e_hardening_unread_results.)"""
    d = Daemon("--max-batch", "2", "--max-unread-bytes", str(512 << 10), world=1)
    try:
        call = start_blocker(d)
        reqs = [dict(prompt="x", width=256, height=256, num_inference_steps=1, seed=30 + k,
                     output_format=RAW) for k in range(2)]
        results, threads = run_concurrently(d, reqs)
        assert d.info().queue_depth == 2
        call.cancel()
        for t in threads:
            t.join(300)
        for k in range(2):
            r = results[k]
            assert not isinstance(r, grpc.RpcError), \
                f"member {k} failed: {r.code().name}: {r.details()}"
            images, res = r
            assert len(images[0]) == 3 * 256 * 256 * 4 and res.seed == 30 + k, res
            assert res.batch_size == 2, res
        d.stop()
    finally:
        d.close()


@case
def replicas():
    """--replicas 2 on ring-2 meshes: four workers, both meshes take work
    from one queue, ServerInfo and the metrics per mesh; a worker of one mesh
    killed mid-request fails only that mesh's request, the other mesh's
    request completes meanwhile, the mesh rebuilds and serves again."""
    d = Daemon("--ring", "2", "--replicas", "2", "--metrics-port", "0", world=2)
    try:
        scrape = scraper(d)
        info = wait_meshes_ready(d)
        assert info.replicas == 2 and len(info.meshes) == 2, info
        assert len(children_of(d.proc.pid)) == 4
        pids = mesh_pids(d)
        assert sorted(pids) == ["mesh0", "mesh1"] and all(len(p) == 2 for p in pids.values()), pids
        # Both meshes serve: two long requests run at once.
        api = d.api
        victim = api.generate(d.channel)(api.request(seed=1, request_id="victim", **LONG),
                                         timeout=600)
        wait_progress(victim)
        busy = [m.running for m in d.info().meshes]
        a = busy.index(1)
        other = api.generate(d.channel)(api.request(seed=2, request_id="other", **dict(
            SMALL, num_inference_steps=150)), timeout=600)
        wait_progress(other)
        assert [m.running for m in d.info().meshes] == [1, 1], d.info()
        os.kill(pids[f"mesh{a}"][1], signal.SIGKILL)
        t0 = time.monotonic()
        expect_code(lambda: ditapi.collect(victim), "UNAVAILABLE")
        print(f"  the killed mesh's request failed after {time.monotonic() - t0:.2f} s")
        kinds, png, res = ditapi.collect(other)
        assert png.startswith(PNG_MAGIC) and res.seed == 2, "the other mesh's request was lost"
        info = wait_meshes_ready(d)
        assert info.meshes[a].worker_restarts == 1 and info.meshes[1 - a].worker_restarts == 0
        assert info.worker_restarts == 1, info
        # Both meshes serve again: eight requests at once spread over them.
        before = [m.requests for m in d.info().meshes]
        calls = [api.generate(d.channel)(api.request(**dict(SMALL, seed=10 + k)), timeout=120)
                 for k in range(8)]
        for c in calls:
            kinds, png, res = ditapi.collect(c)
            assert png.startswith(PNG_MAGIC)
        after = [m.requests for m in d.info().meshes]
        assert all(x > y for x, y in zip(after, before)), (before, after)
        m = scrape()
        for i in (0, 1):
            assert m[f'ditserve_mesh_state{{model="demo",mesh="{i}",state="ready"}}'] == 1, m
            assert m[f'ditserve_mesh_busy_seconds_total{{model="demo",mesh="{i}"}}'] > 0, m
            for r in (0, 1):
                assert m[f'ditserve_worker_resident_bytes{{model="demo",mesh="{i}",rank="{r}"}}'] > 0
        assert m[f'ditserve_worker_restarts_total{{model="demo",mesh="{a}"}}'] == 1, m
        d.stop()
        assert not any(alive(p) for ps in pids.values() for p in ps)
    finally:
        d.close()


@case
def flags():
    """The new flags' bounds and combinations are refused at start with a
    message; /health lists each mesh; LoadLora with several meshes is
    refused with the reason."""
    import subprocess
    from daemon import DEMO, env_path
    for args, needle in [(["--max-batch", "0"], "max-batch"),
                         (["--max-batch", "17"], "max-batch"),
                         (["--replicas", "0"], "replicas"),
                         (["--batch-wait-ms", "-1"], "batch-wait-ms"),
                         (["--replicas", "2", "--local-ranks", "1", "--world-size", "2",
                           "--ring", "2", "--join-listen", "127.0.0.1:0",
                           "--join-secret-file", "/dev/null"], "every rank local")]:
        p = subprocess.run([env_path("DITD"), "--model", DEMO] + args, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert needle in p.stderr, (args, p.stderr)
    d = Daemon("--replicas", "2", "--http-listen", "127.0.0.1:0", world=1)
    try:
        import json
        wait_meshes_ready(d)
        with urllib.request.urlopen(d.http_url + "/health", timeout=10) as r:
            h = json.loads(r.read())
        assert h == {"status": "SERVING", "meshes": [{"mesh": 0, "state": "ready"},
                                                     {"mesh": 1, "state": "ready"}]}, h
        req = d.api.msg("ditserve.v1.LoadLoraRequest")(name="x")
        detail = expect_code(lambda: d.api.lora_rpc(d.channel, "LoadLora")(req, timeout=10),
                             "FAILED_PRECONDITION")
        assert "--replicas" in detail, detail
        d.stop()
    finally:
        d.close()


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
