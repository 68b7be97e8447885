"""End-to-end tests of ditd's HTTP front end (--http-listen): the real
daemon and its real workers, driven by the official `openai` Python client,
raw HTTP, gRPC beside it, and a real browser (Chromium through Selenium)
on the playground page.

    test_http.py CASE      runs one case (meson registers each as a test)
    test_http.py --list    lists the cases
"""

import base64
import http.client
import json
import os
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

import grpc
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import wait_for  # noqa: E402
from daemon import Daemon, run_cases, WAN_DEMO  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPT = "a red fox in the snow"
# Long enough that only a cancel ends it early (seconds per step on CI).
LONG = {"prompt": "a very long job", "size": "512x512", "num_inference_steps": 1000}
GEN = "/v1/images/generations"
VIDEOS = "/v1/videos"
# A small, quick clip of the Wan demo: 5 frames at 8 fps, 2 steps.
CLIP = {"size": "64x48", "seconds": "0.5", "extra_body": {"num_inference_steps": 2, "fps": 8,
                                                            "seed": 7}}
# A clip only a cancel ends early.
LONG_CLIP = {"prompt": "a very long clip", "size": "128x128", "num_frames": 33,
             "num_inference_steps": 1000}

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def client(d, key="no-token", **kw):
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0, **kw)


def grpc_png(d, seed, width=64, height=64, steps=2, prompt=PROMPT, metadata=None):
    call = d.api.generate(d.channel)(
        d.api.request(prompt=prompt, width=width, height=height, num_inference_steps=steps,
                      seed=seed), timeout=120, metadata=metadata)
    _, png, res = ditapi.collect(call)
    assert png.startswith(PNG_MAGIC) and res.seed == seed
    return png


def grpc_pngs(d, seed, n, width=64, height=64, steps=2, prompt=PROMPT):
    """The n PNGs of one gRPC request with num_images = n, split by
    ResultChunk.image_index and checked against Result.image_bytes."""
    call = d.api.generate(d.channel)(
        d.api.request(prompt=prompt, width=width, height=height, num_inference_steps=steps,
                      seed=seed, num_images=n), timeout=120)
    pngs, res = ditapi.collect_images(call)
    assert len(pngs) == n and res.seed == seed, res
    assert all(x.startswith(PNG_MAGIC) for x in pngs)
    return pngs


def http_request(d, method, path, body=None, headers=None, timeout=60, ctx=None):
    """(status, headers, body bytes) of one HTTP request (HTTPS with ctx)."""
    u = urllib.parse.urlsplit(d.http_url)
    if ctx:
        conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers={k: v for k, v in h.items() if v})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def expect_error(d, status, code, body, headers=None, needle="", method="POST", path=GEN):
    """A request that must fail with this status and an OpenAI-shaped error."""
    st, hdrs, raw = http_request(d, method, path, body, headers)
    assert st == status, f"{body!r:.200}: got {st} {raw[:300]!r}, expected {status}"
    assert hdrs.get("content-type") == "application/json", hdrs
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, f"{body!r:.200}: code {err['code']!r}, expected {code!r}"
    assert needle.lower() in err["message"].lower(), f"{err['message']!r} lacks {needle!r}"
    return err


def running(d):
    return d.info().running


def sse_events(raw_lines):
    """Parses server-sent events (the wire format) from lines of bytes."""
    events, data = [], []
    for line in raw_lines:
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                events.append(json.loads(b"\n".join(data)))
            data = []
        elif line.startswith(b"data:"):
            data.append(line[5:].strip())
    return events


# --------------------------------------------------------------------------


@case
def generate():
    """The openai client generates; the PNG is the gRPC path's for the same
    request; n images are one request with num_images = n (diffusers'
    num_images_per_prompt), the PNGs gRPC's num_images gives; a random seed is
    reported and reproduces the image; /v1/models, /health and / answer."""
    d = Daemon("--http-listen", "127.0.0.1:0")
    try:
        c = client(d)
        r = c.images.generate(model="demo", prompt=PROMPT, size="64x64",
                              response_format="b64_json",
                              extra_body={"seed": 7, "num_inference_steps": 2})
        assert len(r.data) == 1 and r.created > 1_600_000_000
        png = base64.b64decode(r.data[0].b64_json)
        assert png == grpc_png(d, 7), "the HTTP image differs from the gRPC one"
        extra = r.model_extra
        assert extra["seed"] == 7 and r.size == "64x64" and r.output_format == "png", extra
        assert r.data[0].model_extra["seed"] == 7
        t = r.data[0].model_extra["timings"]
        assert t["total_ms"] > 0 and t["denoise_ms"] > 0, t
        # n = 2 and 3: one batched request each, num_images = n, every image
        # with the one seed; byte for byte the PNGs of gRPC's num_images = n.
        for n in (2, 3):
            rn = c.images.generate(prompt=PROMPT, size="64x64", n=n,
                                   extra_body={"seed": 7, "num_inference_steps": 2})
            assert len(rn.data) == n and rn.model_extra["seed"] == 7 and rn.size == "64x64"
            assert [x.model_extra["seed"] for x in rn.data] == [7] * n
            got = [base64.b64decode(x.b64_json) for x in rn.data]
            assert got == grpc_pngs(d, 7, n), f"n={n}: HTTP and gRPC num_images differ"
            assert len(set(got)) == n, f"n={n}: images repeat"
        # The largest n: 8, the pipelines' num_images limit.
        r8 = c.images.generate(prompt=PROMPT, size="64x64", n=8,
                               extra_body={"seed": 3, "num_inference_steps": 1})
        assert len(r8.data) == 8 and len({x.b64_json for x in r8.data}) == 8
        # Our extensions change the image; a non-square size comes out so.
        r4 = c.images.generate(prompt=PROMPT, size="96x64", extra_body={
            "seed": 7, "num_inference_steps": 2, "guidance_scale": 5.0, "priority": 3,
            "negative_prompt": "blurry", "true_cfg_scale": 1.5})
        png4 = base64.b64decode(r4.data[0].b64_json)
        assert png4.startswith(PNG_MAGIC) and png4 != png
        assert int.from_bytes(png4[16:20], "big") == 96 and int.from_bytes(png4[20:24], "big") == 64
        # No seed: one is chosen, exact in JSON (below 2^53), and reproduces.
        r5 = c.images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 2})
        seed = r5.data[0].model_extra["seed"]
        assert isinstance(seed, int) and 0 <= seed < 2**53, seed
        assert base64.b64decode(r5.data[0].b64_json) == grpc_png(d, seed)
        # The largest seed comes back exact, as an integer (not 9.00719925474098e+15).
        top = 2**53 - 11
        st, _, body = http_request(d, "POST", GEN, {"prompt": PROMPT, "size": "64x64",
                                                    "num_inference_steps": 1, "seed": top})
        assert st == 200 and b'"seed":9007199254740981' in body, body[-300:]
        assert json.loads(body)["data"][0]["seed"] == top
        st, _, body = http_request(d, "POST", GEN, {"prompt": PROMPT, "size": "64x64",
                                                    "num_inference_steps": 1, "seed": top + 1})
        assert st == 400 and json.loads(body)["error"]["param"] == "seed", body
        # The models list in OpenAI's shape.
        models = c.models.list()
        assert [m.id for m in models.data] == ["demo"] and models.data[0].object == "model"
        st, _, body = http_request(d, "GET", "/health")
        assert st == 200 and json.loads(body) == {
            "status": "SERVING", "meshes": [{"mesh": 0, "state": "ready"}]}, body
        st, hdrs, body = http_request(d, "GET", "/")
        assert st == 200 and hdrs["content-type"].startswith("text/html")
        assert b'id="generate"' in body and b"https://" not in body, "the page must be self-contained"
        assert b'fetch("v1/images/generations"' in body, "the page must use relative URLs"
        d.stop()
    finally:
        d.close()


@case
def stream():
    """stream: true: the openai client reads queued, started and per-step
    progress events, then image_generation.completed with the gRPC path's
    PNG; the raw wire is valid SSE with `event:` and `data:` lines."""
    d = Daemon("--http-listen", "127.0.0.1:0")
    try:
        c = client(d)
        events = list(c.images.generate(prompt=PROMPT, size="64x64", stream=True,
                                        extra_body={"seed": 11, "num_inference_steps": 3}))
        types = [e.type for e in events]
        assert types[0] == "ditserve.queued" and "ditserve.started" in types, types
        assert types[-1] == "image_generation.completed", types
        steps = [e.step for e in events
                 if e.type == "ditserve.progress" and e.stage == "denoising"]
        assert steps == [1, 2, 3], steps
        assert all(e.total_steps == 3 for e in events if e.type == "ditserve.progress")
        # After the last step, the VAE's "decoding", then the image.
        stages = [(e.type, getattr(e, "stage", None)) for e in events]
        last = len(stages) - 1 - stages[::-1].index(("ditserve.progress", "denoising"))
        assert stages[last + 1:] == [("ditserve.progress", "decoding"),
                                     ("image_generation.completed", None)], stages
        done = events[-1]
        assert base64.b64decode(done.b64_json) == grpc_png(d, 11, steps=3)
        assert done.size == "64x64" and done.output_format == "png"
        assert done.model_extra["seed"] == 11 and done.model_extra["timings"]["total_ms"] > 0
        # The wire itself: each event has an `event:` line naming the type
        # inside its data, and the response is an event stream.
        u = urllib.parse.urlsplit(d.http_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", GEN, body=json.dumps({"prompt": PROMPT, "size": "64x64", "seed": 11,
                                                   "num_inference_steps": 3, "stream": True,
                                                   "n": 2}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        assert r.getheader("Cache-Control") == "no-cache"
        lines = r.read().split(b"\n")
        conn.close()
        names = [ln[7:].decode() for ln in lines if ln.startswith(b"event: ")]
        wire = sse_events([ln + b"\n" for ln in lines])
        assert names == [e["type"] for e in wire], (names, [e["type"] for e in wire])
        # n = 2 is one job: the queue, start and progress events are both
        # images' (num_images 2, no index, one step sequence); then one
        # completed event per image, by index, gRPC num_images = 2's PNGs.
        for e in wire:
            if e["type"] in ("ditserve.queued", "ditserve.started", "ditserve.progress"):
                assert e["num_images"] == 2 and "index" not in e, e
        steps = [e["step"] for e in wire
                 if e["type"] == "ditserve.progress" and e["stage"] == "denoising"]
        assert steps == [1, 2, 3], steps
        completed = [e for e in wire if e["type"] == "image_generation.completed"]
        assert [e["index"] for e in completed] == [0, 1], completed
        assert [e["seed"] for e in completed] == [11, 11]
        assert [base64.b64decode(e["b64_json"]) for e in completed] == grpc_pngs(d, 11, 2, steps=3)
        d.stop()
    finally:
        d.close()


@case
def errors():
    """Every refusal in OpenAI's error shape with its HTTP status: bad JSON,
    wrong content type, unknown fields, sizes and values out of range,
    bodies over the limit, unknown model, wrong method and path, queue
    full, draining; the openai client raises its matching exceptions."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--max-queue", "1", "--http-max-body-bytes",
               "4096", "--drain-timeout", "60")
    try:
        ok = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 2}
        expect_error(d, 400, "invalid_json", "{not json", needle="not valid JSON")
        expect_error(d, 400, "invalid_json", "[1, 2]", needle="JSON object")
        expect_error(d, 400, "invalid_json", b'{"prompt": "\xff"}', needle="UTF-8")
        expect_error(d, 400, "invalid_json", '{"prompt": "a\\u0000b"}', needle="u0000")
        expect_error(d, 400, "invalid_content_type", json.dumps(ok),
                     headers={"Content-Type": "text/plain"}, needle="application/json")
        expect_error(d, 400, "invalid_content_type", json.dumps(ok),
                     headers={"Content-Type": None})
        err = expect_error(d, 400, "unknown_parameter", dict(ok, steps=3), needle="'steps'")
        assert err["type"] == "invalid_request_error"
        # A hostile field name is not echoed.
        err = expect_error(d, 400, "unknown_parameter", {"prompt": "x", "\u202e<script>": 1})
        assert "<script>" not in err["message"], err
        expect_error(d, 400, "missing_required_parameter", {"size": "64x64"}, needle="prompt")
        err = expect_error(d, 400, "duplicate_parameter", '{"prompt": "a", "prompt": "b"}')
        assert err["param"] == "prompt", err
        for bad, param, code in [
                ({"size": "63x64"}, None, "invalid_value"),
                ({"size": "64"}, "size", "invalid_value"),
                ({"size": "64x64x1"}, "size", "invalid_value"),
                ({"size": "-64x64"}, "size", "invalid_value"),
                ({"size": "99999999x64"}, "size", "invalid_value"),
                ({"size": "4096x4096"}, None, "invalid_value"),
                ({"n": 0}, "n", "invalid_value"),
                ({"n": 9}, "n", "invalid_value"),
                ({"n": 11}, "n", "invalid_value"),
                ({"n": 1.5}, "n", "invalid_type"),
                ({"n": "2"}, "n", "invalid_type"),
                ({"num_inference_steps": 0}, "num_inference_steps", "invalid_value"),
                ({"num_inference_steps": 1001}, "num_inference_steps", "invalid_value"),
                ({"guidance_scale": "high"}, "guidance_scale", "invalid_type"),
                ({"guidance_scale": -1}, "guidance_scale", "invalid_value"),
                ({"true_cfg_scale": 1e9}, "true_cfg_scale", "invalid_value"),
                ({"seed": -1}, "seed", "invalid_value"),
                ({"seed": 2**60}, "seed", "invalid_value"),
                ({"priority": 1e12}, "priority", "invalid_value"),
                ({"response_format": "url"}, "response_format", "invalid_value"),
                ({"output_format": "jpeg"}, "output_format", "invalid_value"),
                ({"stream": "yes"}, "stream", "invalid_type"),
                ({"partial_images": 2}, "partial_images", "invalid_value"),
                ({"partial_images": "x"}, "partial_images", "invalid_type"),
                ({"partial_images": 1.5}, "partial_images", "invalid_type"),
                ({"prompt": 5}, "prompt", "invalid_type"),
                ({"prompt": "x" * 5000}, None, "body_too_large")]:
            status = 413 if code == "body_too_large" else 400
            err = expect_error(d, status, code, dict(ok, **bad))
            assert err["param"] == param, (bad, err)
        # n over 8: one batch of num_images holds at most 8 images (OpenAI's 10 is not served).
        for n in (9, 10, 10**12):
            expect_error(d, 400, "invalid_value", dict(ok, n=n),
                         needle="'n' must be from 1 to 8: the n images are made as one batch")
        # A body of exactly the limit (4096 bytes, a whole buffer) that ends
        # inside an object: the parser stops at its end (ASan would report
        # a read past it).
        edge = '{"prompt": "' + "a" * (4096 - 14) + '",'
        assert len(edge) == 4096
        expect_error(d, 400, "invalid_json", edge)
        # A body of many small values (the parse tree of such a body is
        # about 40 times its size): refused before it is parsed, at 1025
        # values, whether they are an unknown field's or a known one's.
        many = '{"prompt": "a", "size": "64x64", "x": [' + ",".join(["0"] * 1100) + "]}"
        expect_error(d, 400, "invalid_json", many, needle="more than 1024 JSON values")
        expect_error(d, 400, "invalid_json", '{"loras": [' + ",".join(["{}"] * 600) + "]}",
                     needle="more than 1024 JSON values")
        # Commas and brackets inside strings are text, not values.
        expect_error(d, 400, "invalid_value",
                     dict(ok, prompt="a," * 1000, response_format="url"),
                     needle="response_format")
        # Anything but whitespace after the object.
        expect_error(d, 400, "invalid_json", json.dumps(dict(ok)) + " junk",
                     needle="more after its JSON value")
        # Over the body limit, announced or chunked: 413 either way.
        expect_error(d, 413, "body_too_large", json.dumps(dict(ok, prompt="y" * 8000)),
                     needle="4096")
        u = urllib.parse.urlsplit(d.http_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", GEN, body=iter([b"{" + b" " * 3000] * 4),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "body_too_large"
        conn.close()
        expect_error(d, 404, "model_not_found", dict(ok, model="gpt-image-1"), needle="demo")
        expect_error(d, 404, "not_found", None, method="GET", path="/v1/nothing")
        expect_error(d, 405, "method_not_allowed", None, method="GET", path=GEN)
        expect_error(d, 405, "method_not_allowed", "{}", method="POST", path="/v1/models")
        for path in ("/", "/index.html", "/health"):
            expect_error(d, 405, "method_not_allowed", "{}", method="POST", path=path)
        c = client(d)
        try:
            c.images.generate(prompt=PROMPT, size="64x64", model="nope")
            raise AssertionError("an unknown model was served")
        except openai.NotFoundError as e:
            assert e.status_code == 404 and e.body["code"] == "model_not_found", e.body
        try:
            c.images.generate(prompt=PROMPT, size="65x64")
            raise AssertionError("a bad size was served")
        except openai.BadRequestError as e:
            assert "multiple of 16" in e.body["message"], e.body
        # Queue full (--max-queue 1): a gRPC job runs, an HTTP one waits,
        # the next HTTP request is refused, and so is n = 2.
        long_call = d.api.generate(d.channel)(
            d.api.request(prompt="long", width=512, height=512, num_inference_steps=1000),
            timeout=300)
        next(iter(long_call))
        wait_for(lambda: running(d) == 1, 30, "running job")
        waiting = {}
        t = threading.Thread(target=lambda: waiting.setdefault(
            "r", http_request(d, "POST", GEN, ok, timeout=300)))
        t.start()
        wait_for(lambda: d.info().queue_depth == 1, 30, "queued HTTP request")
        expect_error(d, 429, "queue_full", ok, needle="queue is full")
        try:
            c.images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 2})
            raise AssertionError("a full queue took a request")
        except openai.RateLimitError as e:
            assert e.status_code == 429
        # Draining: new requests get 503 and /health turns 503.
        d.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: http_request(d, "GET", "/health")[0] == 503, 10, "health 503")
        st, _, body = http_request(d, "GET", "/health")
        assert json.loads(body) == {
            "status": "NOT_SERVING", "meshes": [{"mesh": 0, "state": "draining"}]}, body
        expect_error(d, 503, "unavailable", ok, needle="shutting down")
        long_call.cancel()
        t.join(120)
        assert waiting["r"][0] == 200, waiting  # accepted before the drain: served
        rc = d.proc.wait(60)
        assert rc == 0, rc
    finally:
        d.close()


@case
def auth_tls_cors():
    """With --auth-token-file the API needs the bearer token (health and the
    page do not); HTTPS and mutual TLS with the gRPC certificate flags; CORS
    only for the origins given."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_daemon import make_certs
    import httpx2 as httpx
    with tempfile.TemporaryDirectory() as tmp:
        pem = make_certs(tmp)
        token = "s3cret-token-for-the-http-test"
        with open(os.path.join(tmp, "token"), "w") as f:
            f.write(token + "\n")
        d = Daemon("--http-listen", "127.0.0.1:0", "--auth-token-file",
                   os.path.join(tmp, "token"), "--http-cors-origins",
                   "https://app.example,https://other.example")
        try:
            ok = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 2, "seed": 3}
            for hdr in [None, "Bearer wrong-token-wrong-token", "Bearer " + token[:-1],
                        "Basic " + token, token]:
                st, hdrs, body = http_request(d, "POST", GEN, ok, {"Authorization": hdr})
                assert st == 401 and hdrs.get("www-authenticate") == "Bearer", (hdr, st)
                assert json.loads(body)["error"]["code"] == "invalid_api_key"
            st, _, _ = http_request(d, "GET", "/v1/models")
            assert st == 401
            assert http_request(d, "GET", "/health")[0] == 200
            assert http_request(d, "GET", "/")[0] == 200
            try:
                client(d, key="wrong-token").images.generate(prompt=PROMPT, size="64x64")
                raise AssertionError("a wrong token was served")
            except openai.AuthenticationError as e:
                assert e.status_code == 401
            auth = [("authorization", f"Bearer {token}")]
            r = client(d, key=token).images.generate(prompt=PROMPT, size="64x64",
                                                      extra_body={"seed": 3,
                                                                  "num_inference_steps": 2})
            assert base64.b64decode(r.data[0].b64_json) == grpc_png(d, 3, metadata=auth)
            # CORS: an allowed origin is echoed, others get nothing.
            pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type"}
            st, hdrs, _ = http_request(d, "OPTIONS", GEN, None, pre)
            assert st == 204 and hdrs["access-control-allow-origin"] == "https://app.example"
            assert "authorization" in hdrs["access-control-allow-headers"]
            assert "POST" in hdrs["access-control-allow-methods"]
            st, hdrs, _ = http_request(d, "OPTIONS", GEN, None, dict(pre, Origin="https://evil.example"))
            assert "access-control-allow-origin" not in hdrs, hdrs
            st, hdrs, _ = http_request(d, "GET", "/v1/models", None,
                                       {"Origin": "https://other.example",
                                        "Authorization": f"Bearer {token}"})
            assert st == 200 and hdrs["access-control-allow-origin"] == "https://other.example"
            # A page on another origin may read the poll hint of /v1/videos.
            assert "openai-poll-after-ms" in hdrs.get("access-control-expose-headers", ""), hdrs
            st, hdrs, _ = http_request(d, "GET", "/health", None, {"Origin": "https://app.example.evil"})
            assert "access-control-allow-origin" not in hdrs
            # With a list of origins every answer varies by Origin, even one
            # to a request without an Origin or with another one: a cache
            # must not hand that copy to an allowed origin.
            assert hdrs.get("vary") == "Origin", hdrs
            st, hdrs, _ = http_request(d, "GET", "/health")
            assert st == 200 and hdrs.get("vary") == "Origin", hdrs
            d.stop()
        finally:
            d.close()
        # No --http-cors-origins: no CORS headers at all.
        d = Daemon("--http-listen", "127.0.0.1:0")
        try:
            st, hdrs, _ = http_request(d, "OPTIONS", GEN, None, {"Origin": "https://app.example"})
            assert "access-control-allow-origin" not in hdrs
            d.stop()
        finally:
            d.close()
        # HTTPS with the same certificate flags as gRPC.
        d = Daemon("--http-listen", "127.0.0.1:0", "--tls-cert", os.path.join(tmp, "server.pem"),
                   "--tls-key", os.path.join(tmp, "server.key"),
                   creds=grpc.ssl_channel_credentials(pem["ca.pem"]))
        try:
            assert d.http_url.startswith("https://"), d.http_url
            c = client(d, http_client=httpx.Client(verify=os.path.join(tmp, "ca.pem")))
            r = c.images.generate(prompt=PROMPT, size="64x64",
                                  extra_body={"seed": 3, "num_inference_steps": 2})
            assert base64.b64decode(r.data[0].b64_json) == grpc_png(d, 3)
            # Plain HTTP on the HTTPS port gets no answer.
            try:
                st = http_request(d, "GET", "/health", timeout=5)[0]
            except (OSError, http.client.HTTPException):
                st = None
            assert st is None, st
            d.stop()
        finally:
            d.close()
        # Mutual TLS, as on gRPC: a client certificate from the CA is served;
        # none, or one from another CA, gets 403.
        import ssl
        d = Daemon("--http-listen", "127.0.0.1:0", "--tls-cert", os.path.join(tmp, "server.pem"),
                   "--tls-key", os.path.join(tmp, "server.key"), "--tls-client-ca",
                   os.path.join(tmp, "ca.pem"),
                   creds=grpc.ssl_channel_credentials(pem["ca.pem"], pem["client.key"],
                                                      pem["client.pem"]))
        try:
            def ctx_with(name):
                ctx = ssl.create_default_context(cafile=os.path.join(tmp, "ca.pem"))
                if name:
                    ctx.load_cert_chain(os.path.join(tmp, f"{name}.pem"),
                                        os.path.join(tmp, f"{name}.key"))
                return ctx
            c = client(d, http_client=httpx.Client(verify=ctx_with("client")))
            r = c.images.generate(prompt=PROMPT, size="64x64",
                                  extra_body={"seed": 3, "num_inference_steps": 2})
            assert base64.b64decode(r.data[0].b64_json) == grpc_png(d, 3)
            for name in (None, "other"):
                for method, path in (("GET", "/health"), ("POST", GEN)):
                    try:
                        st, _, body = http_request(d, method, path, {"prompt": "x"},
                                                   ctx=ctx_with(name))
                    except (OSError, http.client.HTTPException) as e:
                        st, body = None, repr(e).encode()
                    assert st == 403, (name, path, st, body)
                    err = json.loads(body)["error"]
                    assert err["code"] == "client_certificate_required", err
            assert http_request(d, "GET", "/health", ctx=ctx_with("client"))[0] == 200
            d.stop()
        finally:
            d.close()


def raw_post(d, body):
    """A socket with a generation request sent on it (the answer unread)."""
    u = urllib.parse.urlsplit(d.http_url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


@case
def disconnect():
    """A client that goes away cancels its request: running (plain and
    streamed) at the next step, waiting in the queue at once; the daemon
    then serves the next request."""
    d = Daemon("--http-listen", "127.0.0.1:0")
    try:
        for stream in (False, True):
            s = raw_post(d, dict(LONG, stream=stream))
            if stream:
                got = b""
                while b"ditserve.progress" not in got:
                    got += s.recv(4096)
            wait_for(lambda: running(d) == 1, 30, "running job")
            time.sleep(0.3)
            s.close()
            t0 = time.monotonic()
            wait_for(lambda: running(d) == 0, 10, "cancel of the running job")
            took = time.monotonic() - t0
            print(f"stream={stream}: stopped {took:.2f} s after the client left")
            # At its next step (the socket is looked at every 200 ms; a step
            # of LONG is tens of ms), not by running on to the end.
            assert took < 2.0, f"the job ran {took:.1f} s after its client left"
        assert d.log().count("the HTTP client disconnected") == 2, d.log()
        # Queued: waits behind a gRPC job, its client leaves, it leaves the queue.
        long_call = d.api.generate(d.channel)(
            d.api.request(prompt="long", width=512, height=512, num_inference_steps=1000),
            timeout=300)
        next(iter(long_call))
        wait_for(lambda: running(d) == 1, 30, "running gRPC job")
        s = raw_post(d, {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 2})
        wait_for(lambda: d.info().queue_depth == 1, 10, "queued HTTP request")
        s.close()
        wait_for(lambda: d.info().queue_depth == 0, 10, "the queued request leaving")
        assert "cancelled while queued" in d.log()
        long_call.cancel()
        wait_for(lambda: running(d) == 0, 10, "cancel of the gRPC job")
        r = client(d).images.generate(prompt=PROMPT, size="64x64",
                                      extra_body={"seed": 1, "num_inference_steps": 2})
        assert base64.b64decode(r.data[0].b64_json).startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


def raw_exchange(d, head, body=b""):
    """Sends a request's bytes as given; (status, the answer's bytes)."""
    u = urllib.parse.urlsplit(d.http_url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return int(got.split(b" ", 2)[1]), got


@case
def cross_site_and_framing():
    """A page of another origin may not POST (a form posts across sites
    without a preflight, and without a token the server cannot tell it
    from its user): 403 cross_origin_refused, unless --http-cors-origins
    lists it (blanks around the list's entries are not part of them); the
    same origin (the playground) may. A body whose length could be read two
    ways (two Content-Length headers, Transfer-Encoding beside one, an
    encoding other than chunked) is 400 invalid_framing; chunked alone is
    fine."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--http-cors-origins",
               "https://a.example, https://b.example")
    try:
        u = urllib.parse.urlsplit(d.http_url)
        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 1, "seed": 1}
        for origin in ("https://evil.example", "null", "http://localhost:1"):
            st, _, raw = http_request(d, "POST", GEN, body, headers={"Origin": origin})
            err = json.loads(raw)["error"]
            assert st == 403 and err["code"] == "cross_origin_refused", (origin, st, raw)
        st, _, raw = http_request(d, "DELETE", f"{VIDEOS}/video_0", headers={"Origin": "https://evil.example"})
        assert st == 403, (st, raw)
        for origin in ("https://b.example", f"http://{u.hostname}:{u.port}", None):
            st, hdrs, raw = http_request(d, "POST", GEN, body, headers={"Origin": origin})
            assert st == 200, (origin, st, raw[:300])
        st, hdrs, _ = http_request(d, "OPTIONS", GEN, headers={"Origin": "https://b.example"})
        assert st == 204 and hdrs.get("access-control-allow-origin") == "https://b.example", hdrs

        data = json.dumps(body).encode()
        n = str(len(data)).encode()
        start = b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for extra in (b"Content-Length: " + n + b"\r\nContent-Length: 5\r\n",
                      b"Transfer-Encoding: chunked\r\nContent-Length: " + n + b"\r\n",
                      b"Transfer-Encoding: xchunked\r\n"):
            st, got = raw_exchange(d, start + extra + b"Connection: close\r\n\r\n", data)
            assert st == 400 and b"invalid_framing" in got, (extra, got[:400])
        chunked = hex(len(data))[2:].encode() + b"\r\n" + data + b"\r\n0\r\n\r\n"
        st, got = raw_exchange(d, start + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
                               chunked)
        assert st == 200, got[:400]
        assert http_request(d, "GET", "/health")[0] == 200
        d.stop()
    finally:
        d.close()


def closed_by_server(sock, timeout_s):
    """True when the server closes this socket within timeout_s."""
    sock.settimeout(timeout_s)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@case
def slow_clients():
    """Idle and slow clients are bounded: past --http-max-connections new
    connections are refused at once, silent ones close after
    --http-idle-timeout, a body that trickles in is cut off at
    --http-request-timeout, headers that trickle in on every slot give up
    their place to a new connection past it, and then requests are served
    again."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--http-max-connections", "4",
               "--http-idle-timeout", "2", "--http-request-timeout", "3")
    u = urllib.parse.urlsplit(d.http_url)
    socks = []
    try:
        opened = time.monotonic()
        socks = [socket.create_connection((u.hostname, u.port)) for _ in range(4)]
        time.sleep(0.3)
        extra = socket.create_connection((u.hostname, u.port))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        # Refused at once: closed within a second, with not a byte of answer.
        extra.settimeout(1.0)
        try:
            answer = extra.recv(4096)
        except ConnectionResetError:
            answer = b""
        except socket.timeout:
            raise AssertionError("a connection past the limit was kept open")
        assert answer == b"", f"a connection past the limit was served: {answer[:80]!r}"
        extra.close()
        for s in socks:
            assert closed_by_server(s, 10), "an idle connection stayed open"
        idle = time.monotonic() - opened
        # --http-idle-timeout 2, in whole seconds as libmicrohttpd counts them.
        assert 1.5 <= idle <= 6, f"idle connections closed after {idle:.1f} s"
        assert http_request(d, "GET", "/health")[0] == 200
        # A body that trickles in, a byte a second (never idle for 2 s).
        t0 = time.monotonic()
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\n\r\n")
        cut = False
        for _ in range(20):
            try:
                s.sendall(b" ")
            except OSError:
                cut = True
                break
            if closed_by_server(s, 1.0):
                cut = True
                break
        took = time.monotonic() - t0
        s.close()
        # --http-request-timeout 3: not before, and not long after.
        assert cut and 2.5 <= took <= 8, f"the slow body was cut off after {took:.1f} s"
        print(f"idle connections closed after {idle:.1f} s, a trickling body after {took:.1f} s")
        # Headers that trickle in on every slot (never idle for 2 s): past
        # --http-request-timeout a new connection takes the oldest's place.
        socks = [socket.create_connection((u.hostname, u.port)) for _ in range(4)]
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:
            for s in socks:
                s.sendall(b"a")
            time.sleep(0.5)
        code = http_request(d, "GET", "/health")[0]
        assert code == 200, f"the slots held by trickling headers stayed held ({code})"
        assert any(closed_by_server(s, 2) for s in socks), "no trickling connection was closed"
        r = client(d).images.generate(prompt=PROMPT, size="64x64",
                                      extra_body={"seed": 1, "num_inference_steps": 2})
        assert base64.b64decode(r.data[0].b64_json).startswith(PNG_MAGIC)
        d.stop()
    finally:
        for s in socks:
            s.close()
        d.close()


@case
def short_idle_timeout():
    """--http-idle-timeout under a second: rounded up to one (libmicrohttpd
    counts whole seconds, and 0 would be none), so a silent connection
    closes; an event stream whose job waits in the queue is kept alive by
    comments twice within it, and completes."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--http-idle-timeout", "0.4")
    u = urllib.parse.urlsplit(d.http_url)
    try:
        # Timed from before the connect, so that a stall of this client
        # cannot shorten what it measures.
        t0 = time.monotonic()
        silent = socket.create_connection((u.hostname, u.port))
        assert closed_by_server(silent, 5), "a silent connection stayed open"
        closed = time.monotonic() - t0
        print(f"  a silent connection closed after {closed:.1f} s")
        assert 0.8 <= closed <= 3.0, f"0.4 s rounds up to 1 s, not {closed:.1f} s"
        silent.close()
        blocker = d.api.generate(d.channel)(
            d.api.request(prompt="long", width=512, height=512, num_inference_steps=1000),
            timeout=300)
        next(iter(blocker))
        s = raw_post(d, {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 2,
                         "stream": True})
        wait_for(lambda: d.info().queue_depth == 1, 10, "the queued stream")
        got, beats = b"", []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            s.settimeout(3)
            chunk = s.recv(65536)
            assert chunk, f"the stream was closed while its job waited: {got!r}"
            got += chunk
            beats += [time.monotonic()] * chunk.count(b": keep-alive")
        # Twice within the 1 s timeout: about six in 3 s. (A gap the idle
        # timeout closes ends the stream, which the loop above catches; the
        # times this client read them are no measure of when they were sent.)
        assert len(beats) >= 4, len(beats)
        blocker.cancel()
        s.settimeout(60)
        while b"image_generation.completed" not in got:
            chunk = s.recv(65536)
            assert chunk, f"the stream ended without its image: {got[-300:]!r}"
            got += chunk
        s.close()
        d.stop()
    finally:
        d.close()


@case
def unread_results():
    """Results waiting for HTTP clients that do not read count toward
    --max-unread-total with gRPC's: past it new requests are refused with
    RESOURCE_EXHAUSTED (429 over HTTP), and once the client goes they are
    served again."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--max-unread-total", str(4 << 20))
    try:
        u = urllib.parse.urlsplit(d.http_url)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((u.hostname, u.port))
        # Eight 512x512 PNGs, about 6 MB of base64: more than the sockets hold.
        data = json.dumps({"prompt": PROMPT, "size": "512x512", "n": 8,
                           "num_inference_steps": 1}).encode()
        s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(data)).encode() +
                  b"\r\n\r\n" + data)
        wait_for(lambda: "shape=512x512" in d.log(), 120, "the unread request's end")
        try:
            d.generate(timeout=30, seed=5, prompt=PROMPT, width=64, height=64,
                       num_inference_steps=1)
            raise AssertionError("admitted past --max-unread-total")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "--max-unread-total" in e.details(), e.details()
        st, _, body = http_request(d, "POST", GEN, {"prompt": PROMPT, "size": "64x64",
                                                    "num_inference_steps": 1})
        assert st == 429, (st, body)
        s.close()
        t0 = time.monotonic()
        while True:
            try:
                d.generate(timeout=30, seed=6, prompt=PROMPT, width=64, height=64,
                           num_inference_steps=1)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                    time.monotonic() - t0 < 20, e
                time.sleep(0.2)
        d.stop()
    finally:
        d.close()


@case
def load():
    """200 requests from 50 clients, half over HTTP (the openai client) and
    half over gRPC, all served, the same seed giving the same image on both;
    then the HTTP path's overhead per request against gRPC's, measured
    alternately in the same run."""
    d = Daemon("--http-listen", "127.0.0.1:0", "--max-queue", "200")
    try:
        results, errors, served = {}, [], []
        lock = threading.Lock()

        # Seeds 0 .. 7 on both paths (k + 4 i // 2 over each path's 25
        # clients): each seed's images from HTTP and from gRPC must be one.
        def seed_of(i, k):
            return (k + 4 * (i // 2)) % 8

        def http_worker(i):
            c = client(d, timeout=600)
            for k in range(4):
                seed = seed_of(i, k)
                try:
                    r = c.images.generate(prompt=PROMPT, size="64x64",
                                          extra_body={"seed": seed, "num_inference_steps": 1,
                                                      "priority": k})
                    with lock:
                        results.setdefault((seed, "http"), set()).add(r.data[0].b64_json)
                        served.append(seed)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"http {i}/{k}: {e!r}")

        def grpc_worker(i):
            ch = d.connect()
            for k in range(4):
                seed = seed_of(i, k)
                try:
                    call = d.api.generate(ch)(d.api.request(
                        prompt=PROMPT, width=64, height=64, num_inference_steps=1, seed=seed,
                        priority=k), timeout=600)
                    _, png, _ = ditapi.collect(call)
                    with lock:
                        results.setdefault((seed, "grpc"), set()).add(
                            base64.b64encode(png).decode())
                        served.append(seed)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"grpc {i}/{k}: {e!r}")
            ch.close()

        threads = [threading.Thread(target=http_worker if i % 2 else grpc_worker, args=(i,))
                   for i in range(50)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        wall = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a client is still waiting"
        assert not errors, errors[:5]
        assert len(served) == 200, len(served)
        assert sorted(results) == [(s, p) for s in range(8) for p in ("grpc", "http")], results
        for s in range(8):
            one = results[(s, "http")]
            assert len(one) == 1 and one == results[(s, "grpc")], \
                f"seed {s}: HTTP and gRPC gave different images"
        print(f"200 requests (100 HTTP, 100 gRPC) from 50 clients in {wall:.1f} s")
        # Overhead: the same request, one after the other, alternating.
        c = client(d)
        g, h = [], []
        for k in range(30):
            t0 = time.monotonic()
            grpc_png(d, 5, steps=1)
            g.append(time.monotonic() - t0)
            t0 = time.monotonic()
            r = c.images.generate(prompt=PROMPT, size="64x64",
                                  extra_body={"seed": 5, "num_inference_steps": 1})
            assert r.data[0].b64_json
            h.append(time.monotonic() - t0)
        gm, hm = statistics.median(g) * 1e3, statistics.median(h) * 1e3
        print(f"median per request, demo 64x64, 1 step, 30 each: gRPC {gm:.1f} ms, "
              f"HTTP {hm:.1f} ms, HTTP overhead {hm - gm:+.1f} ms")
        assert "HTTP client disconnected" not in d.log()
        d.stop()
    finally:
        d.close()


@case
def browser():
    """Chromium (through Selenium) loads the playground, fills the form,
    clicks Generate, sees the progress bar advance, and gets the image at
    the size it asked for, with its seed and timings."""
    import shutil
    chromedriver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not os.path.exists(chromedriver):
        print("SKIP: chromedriver is not installed (deploy/install-deps.sh installs it)")
        return 77
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    d = Daemon("--http-listen", "127.0.0.1:0")
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    for b in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.path.exists(b):
            opts.binary_location = b
    drv = webdriver.Chrome(service=Service(chromedriver), options=opts)
    try:
        drv.set_page_load_timeout(60)
        drv.get(d.http_url + "/")
        assert "ditserve playground" in drv.title

        def fill(id_, value):
            el = drv.find_element(By.ID, id_)
            el.clear()
            el.send_keys(str(value))

        fill("prompt", "a lighthouse at dusk")
        fill("negative_prompt", "blurry")
        fill("width", 96)
        fill("height", 64)
        fill("steps", 600)
        fill("guidance", 4)
        fill("seed", 1234)
        drv.find_element(By.ID, "generate").click()
        seen = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            v = drv.execute_script(
                "const p = document.getElementById('progress'); return [p.value, p.max];")
            if not seen or seen[-1] != v:
                seen.append(v)
            if drv.execute_script("return document.getElementById('result').complete && "
                                  "document.getElementById('result').naturalWidth > 0"):
                break
            time.sleep(0.02)
        status = drv.find_element(By.ID, "status").text
        assert status == "Done", (status, seen)
        partial = [v for v, m in seen if 0 < v < m]
        assert len(partial) >= 2 and partial == sorted(partial), f"progress did not advance: {seen}"
        size = drv.execute_script("const i = document.getElementById('result');"
                                  "return [i.naturalWidth, i.naturalHeight];")
        assert size == [96, 64], size
        details = drv.find_element(By.ID, "details").text
        assert "seed 1234" in details and "total_ms" in details, details
        # The page's image is the one gRPC makes for the same request.
        src = drv.execute_script("return document.getElementById('result').src")
        png = base64.b64decode(src.split(",", 1)[1])
        call = d.api.generate(d.channel)(d.api.request(
            prompt="a lighthouse at dusk", negative_prompt="blurry", width=96, height=64,
            num_inference_steps=600, guidance_scale=4.0, seed=1234), timeout=120)
        assert png == ditapi.collect(call)[1]
        # An error reaches the page too (a size the form allows, the server
        # not: past --max-pixels).
        fill("width", 4096)
        fill("height", 4096)
        drv.find_element(By.ID, "generate").click()
        wait_for(lambda: "max-pixels" in drv.find_element(By.ID, "status").text, 30,
                 "the error on the page")
        assert drv.find_element(By.ID, "status").text.startswith("HTTP 400")
        print(f"progress values seen: {len(seen)}, {partial[:3]} ... {partial[-3:]}")
        d.stop()
    finally:
        drv.quit()
        d.close()


# --------------------------------------------------------------------------
# /v1/videos on the Wan demo


def wait_video(c, vid, timeout_s=120):
    """Polls a video until it ends; returns it and the progress values seen."""
    seen, t0 = [], time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = c.videos.retrieve(vid)
        seen.append(v.progress)
        if v.status in ("completed", "failed"):
            return v, seen
        time.sleep(0.05)
    raise AssertionError(f"video {vid} did not end within {timeout_s} s")


def video_error(err_cls, fn):
    try:
        fn()
    except err_cls as e:
        return e.body
    raise AssertionError(f"no {err_cls.__name__}")


@case
def videos():
    """The openai client creates a video (a multipart form), polls it to
    completed and downloads an H.264 MP4 with the frames and size asked for,
    the gRPC path's for the same request; JSON bodies, num_frames and the
    seconds rule; list (pages bounded in bytes, `after` a deleted job),
    variants, delete; images from the video model stay one-frame PNGs."""
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # the client marks Sora's API so
    d = Daemon("--http-listen", "127.0.0.1:0", model=WAN_DEMO)
    try:
        c = client(d)
        m = c.models.list().data[0].model_extra
        assert m["task"] == "text-to-video" and m["default_num_frames"] == 81, m
        assert m["default_fps"] == 16 and m["frame_step"] == 4 and m["default_size"] == "832x480"
        v = c.videos.create(prompt=PROMPT, **CLIP)
        assert re.fullmatch(r"video_[0-9a-f]{32}", v.id), v.id
        assert v.object == "video" and v.status in ("queued", "in_progress", "completed"), v
        assert v.model == "wan_demo" and v.size == "64x48" and v.prompt == PROMPT, v
        # 0.5 s at 8 fps: 4 frames, and the nearest count Wan takes is 5.
        assert v.model_extra["num_frames"] == 5 and v.model_extra["fps"] == 8, v
        assert v.seconds == "0.625" and v.error is None and v.created_at > 1_600_000_000, v
        done, seen = wait_video(c, v.id)
        assert done.status == "completed" and done.progress == 100, done
        assert seen == sorted(seen), seen
        assert done.completed_at >= done.created_at, done
        assert done.expires_at == done.completed_at + 3600, done
        assert done.model_extra["seed"] == 7 and done.model_extra["timings"]["total_ms"] > 0
        mp4 = c.videos.download_content(v.id).read()
        assert ditapi.mp4_info(mp4) == (64, 48, 5), ditapi.mp4_info(mp4)
        # openai's poll() helper ends on the same object.
        assert c.videos.poll(v.id).status == "completed"
        # gRPC's MP4 for the same request: the same video, the same bytes
        # (the same frames into the same encoder, on the same CPU).
        call = d.api.generate(d.channel)(d.api.request(
            prompt=PROMPT, width=64, height=48, num_frames=5, fps=8, num_inference_steps=2,
            seed=7, output_format="OUTPUT_FORMAT_MP4"), timeout=120)
        _, g_mp4, res = ditapi.collect(call)
        assert (res.width, res.height, res.num_frames, res.fps) == (64, 48, 5, 8), res
        assert ditapi.mp4_info(g_mp4) == ditapi.mp4_info(mp4)
        assert g_mp4 == mp4, f"HTTP MP4 {len(mp4)} bytes, gRPC MP4 {len(g_mp4)} bytes, different"
        # The raw HTTP response: video/mp4, the same bytes.
        st, hdrs, body = http_request(d, "GET", f"{VIDEOS}/{v.id}/content?variant=video")
        assert st == 200 and hdrs["content-type"] == "video/mp4" and body == mp4, (st, hdrs)
        # A JSON body with num_frames; seconds "1" at 16 fps makes 17 frames.
        st, hdrs, body = http_request(d, "POST", VIDEOS, {
            "prompt": "a boat", "size": "32x32", "num_frames": 9, "num_inference_steps": 2,
            "seed": 3, "guidance_scale": 4.0, "negative_prompt": "fog", "priority": 2})
        assert st == 200 and hdrs["openai-poll-after-ms"], (st, body)
        v9 = json.loads(body)
        assert v9["num_frames"] == 9 and v9["fps"] == 16 and v9["seconds"] == "0.5625", v9
        v17 = c.videos.create(prompt="a boat", size="32x32", seconds="1",
                              extra_body={"num_inference_steps": 1})
        assert v17.model_extra["num_frames"] == 17 and v17.seconds == "1.0625", v17
        for vid, frames in ((v9["id"], 9), (v17.id, 17)):
            assert wait_video(c, vid)[0].status == "completed"
            assert ditapi.mp4_info(c.videos.download_content(vid).read()) == (32, 32, frames)
        # The list, newest first, in pages.
        page = c.videos.list()
        assert [x.id for x in page.data] == [v17.id, v9["id"], v.id], page
        first = c.videos.list(limit=1, order="asc")
        assert [x.id for x in first.data] == [v.id] and first.has_more
        rest = c.videos.list(after=v.id, order="asc")
        assert [x.id for x in rest.data] == [v9["id"], v17.id] and not rest.has_more
        # Variants: only the MP4 exists.
        expect_error(d, 404, "variant_not_available", None, method="GET",
                     path=f"{VIDEOS}/{v.id}/content?variant=thumbnail")
        expect_error(d, 400, "invalid_value", None, method="GET",
                     path=f"{VIDEOS}/{v.id}/content?variant=gif")
        # Unknown ids: 404 in OpenAI's shape; the client raises NotFoundError.
        body = video_error(openai.NotFoundError, lambda: c.videos.retrieve("video_" + "0" * 32))
        assert body["code"] == "video_not_found", body
        for path in (f"{VIDEOS}/nope", f"{VIDEOS}/{v.id}x", f"{VIDEOS}/{v.id}/content/x",
                     f"{VIDEOS}/{'video_' + 'f' * 32}/content"):
            expect_error(d, 404, "video_not_found" if "content/x" not in path else "not_found",
                         None, method="GET", path=path)
        expect_error(d, 405, "method_not_allowed", None, method="DELETE", path=VIDEOS)
        expect_error(d, 405, "method_not_allowed", None, method="POST", path=f"{VIDEOS}/{v.id}")
        # Delete: gone from status, content and the list.
        r = c.videos.delete(v.id)
        assert r.id == v.id and r.deleted and r.object == "video.deleted", r
        video_error(openai.NotFoundError, lambda: c.videos.retrieve(v.id))
        video_error(openai.NotFoundError, lambda: c.videos.download_content(v.id))
        video_error(openai.NotFoundError, lambda: c.videos.delete(v.id))
        assert v.id not in [x.id for x in c.videos.list().data]
        # A page stops taking items once their JSON passes 4 MiB (one item
        # always goes) and says has_more: each item echoes its prompt, here
        # 60000 control characters, each 6 bytes as a JSON escape.
        held = [v9["id"], v17.id]
        big = {"prompt": "\x01" * 60000, "size": "32x32", "num_frames": 5,
               "num_inference_steps": 1}
        for k in range(16):
            st, _, body = http_request(d, "POST", VIDEOS, dict(big, seed=k))
            assert st == 200, body[:300]
            held.append(json.loads(body)["id"])
        for vid in held[2:]:
            assert wait_video(c, vid)[0].status == "completed"
        st, _, raw = http_request(d, "GET", f"{VIDEOS}?limit=100&order=asc")
        page = json.loads(raw)
        got = [x["id"] for x in page["data"]]
        assert st == 200 and page["has_more"] and 2 < len(got) < len(held), (len(got), len(raw))
        assert len(raw) < (4 << 20) + 400_000, len(raw)
        assert got == held[:len(got)] and page["last_id"] == got[-1], got
        st, _, raw = http_request(d, "GET", f"{VIDEOS}?limit=100&order=asc&after={got[-1]}")
        page = json.loads(raw)
        assert st == 200 and not page["has_more"], page["has_more"]
        assert got + [x["id"] for x in page["data"]] == held
        # The client's auto-pagination goes through every page, either way.
        assert [x.id for x in c.videos.list(limit=100, order="asc")] == held
        assert [x.id for x in c.videos.list(limit=100)] == held[::-1]
        # `after` naming a deleted job goes on from its place, both ways;
        # an id never held is 404.
        assert [x.id for x in c.videos.list(after=v.id, order="asc", limit=100)] == held
        c.videos.delete(held[5])
        page = c.videos.list(after=held[5], order="asc", limit=3)
        assert [x.id for x in page.data] == held[6:9] and page.has_more, page
        page = c.videos.list(after=held[5], limit=3)
        assert [x.id for x in page.data] == held[4:1:-1] and page.has_more, page
        del held[5]
        expect_error(d, 404, "video_not_found", None, method="GET",
                     path=f"{VIDEOS}?after=video_{'0' * 32}")
        # So a client may delete what it lists as it pages on.
        seen = []
        for x in c.videos.list(limit=5, order="asc"):
            seen.append(x.id)
            c.videos.delete(x.id)
        assert seen == held and c.videos.list().data == [], seen
        # /v1/images/generations on the video model: one frame, as a PNG.
        img = c.images.generate(prompt=PROMPT, size="32x32", extra_body={"num_inference_steps": 1})
        assert base64.b64decode(img.data[0].b64_json).startswith(PNG_MAGIC)
        d.stop()
    finally:
        d.close()


@case
def video_errors():
    """Bad fields in forms and JSON get 400 in OpenAI's shape (the client
    raises BadRequestError); an image model refuses /v1/videos; the bearer
    token guards every video endpoint."""
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    with tempfile.TemporaryDirectory() as tmp:
        token = "s3cret-token-for-the-video-test"
        with open(os.path.join(tmp, "token"), "w") as f:
            f.write(token + "\n")
        d = Daemon("--http-listen", "127.0.0.1:0", "--auth-token-file",
                   os.path.join(tmp, "token"), model=WAN_DEMO)
        try:
            c = client(d, key=token)
            bad = [  # (create's arguments, code, words in the message)
                (dict(size="64x"), "invalid_value", "WIDTHxHEIGHT"),
                (dict(size="40x40"), "invalid_value", "multiple of 16"),
                (dict(seconds="abc"), "invalid_value", "seconds"),
                (dict(seconds="0"), "invalid_value", "seconds"),
                (dict(seconds="-4"), "invalid_value", "seconds"),
                (dict(seconds="1e3"), "invalid_value", "seconds"),
                (dict(seconds="4", extra_body={"num_frames": 9}), "invalid_value", "not both"),
                (dict(extra_body={"num_frames": 4}), "invalid_value", "num_frames 4"),
                (dict(extra_body={"num_frames": "nine"}), "invalid_type", "integer"),
                (dict(extra_body={"fps": 0}), "invalid_value", "fps"),
                (dict(extra_body={"seed": -1}), "invalid_value", "seed"),
                (dict(extra_body={"num_inference_steps": "2.5"}), "invalid_type", "integer"),
                (dict(extra_body={"guidance_scale": "nan"}), "invalid_type", "number"),
                (dict(extra_body={"style": "noir"}), "unknown_parameter", "'style'"),
                (dict(input_reference=("ref.png", PNG_MAGIC, "image/png")),
                 "unsupported_parameter", "input_reference"),
            ]
            for kw, code, needle in bad:
                kw = dict(kw)
                kw.setdefault("size", "32x32")
                extra = dict({"num_inference_steps": 1}, **kw.pop("extra_body", {}))
                body = video_error(openai.BadRequestError, lambda: c.videos.create(
                    prompt=PROMPT, extra_body=extra, **kw))
                assert body["code"] == code, (kw, body)
                assert needle.lower() in body["message"].lower(), (kw, body)
            # The same checks for JSON bodies, and what only JSON can get wrong.
            auth = {"Authorization": "Bearer " + token}
            for body, code in [({"size": "32x32"}, "missing_required_parameter"),
                               ({"prompt": 5}, "invalid_type"),
                               ({"prompt": "x", "seconds": [4]}, "invalid_value"),
                               ('{"prompt": "x", "prompt": "y"}', "duplicate_parameter"),
                               ('{"prompt": "x", "loras": [{"name": "a", "name": "b"}]}',
                                "duplicate_parameter"),
                               # 144001 frames, past num_frames' own limit of 100000
                               ({"prompt": "x", "seconds": "600", "fps": 240}, "invalid_value"),
                               ("[1]", "invalid_json"), ("{", "invalid_json")]:
                expect_error(d, 400, code, body, headers=auth, path=VIDEOS)
            expect_error(d, 400, "invalid_content_type", "prompt=x", path=VIDEOS,
                         headers=dict(auth, **{"Content-Type": "text/plain"}))
            # A form given a field twice.
            boundary = "b0undary"
            form = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n'
                           f"\r\n{p}\r\n" for p in ("a", "b")) + f"--{boundary}--\r\n"
            expect_error(d, 400, "duplicate_parameter", form, path=VIDEOS, headers=dict(
                auth, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}))
            # Forms that do not parse: no boundary; a NUL byte; a value not UTF-8.
            expect_error(d, 400, "invalid_form", form, path=VIDEOS,
                         headers=dict(auth, **{"Content-Type": "multipart/form-data"}))
            for value in (b"a\x00b", b"\xff\xfe"):
                raw = (f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n'
                       .encode() + value + f"\r\n--{boundary}--\r\n".encode())
                expect_error(d, 400, "invalid_form", raw, path=VIDEOS, headers=dict(
                    auth, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}))
            expect_error(d, 400, "invalid_type", "prompt=x&seed=abc", path=VIDEOS, headers=dict(
                auth, **{"Content-Type": "application/x-www-form-urlencoded"}))
            # A form's loras text is held to a body's rules: no \u0000, nothing after it.
            for text in ('[{"name": "style\\u0000../x"}]', '[{"name": "style"}] junk'):
                expect_error(d, 400, "invalid_json",
                             urllib.parse.urlencode({"prompt": "x", "loras": text}), path=VIDEOS,
                             headers=dict(auth, **{"Content-Type":
                                                   "application/x-www-form-urlencoded"}))
            # A form announcing a body past the limit: 413 before any of it is sent.
            u = urllib.parse.urlsplit(d.http_url)
            with socket.create_connection((u.hostname, u.port), timeout=10) as sk:
                sk.sendall(f"POST {VIDEOS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                           f"{token}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                           f"Content-Length: 100000000000\r\n\r\n".encode())
                first = sk.recv(4096).split(b"\r\n")[0]
                assert first.startswith(b"HTTP/1.1 413 "), first
            # The bearer token, on every endpoint.
            vid = c.videos.create(prompt=PROMPT, size="32x32",
                                  extra_body={"num_inference_steps": 1, "num_frames": 5}).id
            for method, path in [("POST", VIDEOS), ("GET", VIDEOS), ("GET", f"{VIDEOS}/{vid}"),
                                 ("GET", f"{VIDEOS}/{vid}/content"),
                                 ("DELETE", f"{VIDEOS}/{vid}")]:
                for hdr in (None, "Bearer wrong-token"):
                    st, hdrs, _ = http_request(d, method, path, {"prompt": "x"},
                                               {"Authorization": hdr})
                    assert st == 401 and hdrs.get("www-authenticate") == "Bearer", (path, st)
            video_error(openai.AuthenticationError,
                        lambda: client(d, key="wrong").videos.retrieve(vid))
            assert wait_video(c, vid)[0].status == "completed"
            assert c.videos.download_content(vid).read()[4:8] == b"ftyp"
            d.stop()
        finally:
            d.close()
    # An image model: /v1/videos says it makes images.
    d = Daemon("--http-listen", "127.0.0.1:0")
    try:
        c = client(d)
        assert c.models.list().data[0].model_extra["task"] == "text-to-image"
        body = video_error(openai.BadRequestError,
                           lambda: c.videos.create(prompt=PROMPT, size="64x64"))
        assert body["code"] == "model_makes_images" and "/v1/images" in body["message"], body
        d.stop()
    finally:
        d.close()


@case
def video_store():
    """The store holds --http-video-jobs jobs (more: 429, until one is
    deleted); DELETE cancels a running job and a queued one, and the queue
    goes on; finished jobs expire after --http-video-retention; a clip that
    does not fit --http-video-bytes fails with video_store_full."""
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    d = Daemon("--http-listen", "127.0.0.1:0", "--http-video-jobs", "3",
               "--http-video-retention", "2", model=WAN_DEMO)
    try:
        c = client(d)
        long_id = json.loads(http_request(d, "POST", VIDEOS, LONG_CLIP)[2])["id"]
        wait_for(lambda: c.videos.retrieve(long_id).status == "in_progress", 30, "a running job")
        wait_for(lambda: c.videos.retrieve(long_id).progress > 0, 60, "progress")  # step 10 of 1000
        queued = c.videos.create(prompt=PROMPT, **CLIP)
        assert c.videos.retrieve(queued.id).status == "queued"
        small = c.videos.create(prompt=PROMPT, **CLIP)
        # Three held: the fourth is refused, in OpenAI's shape (RateLimitError).
        body = video_error(openai.RateLimitError, lambda: c.videos.create(prompt=PROMPT, **CLIP))
        assert body["code"] == "video_store_full" and "--http-video-jobs" in body["message"], body
        # Deleting the queued job takes it out of the queue.
        assert d.info().queue_depth == 2
        c.videos.delete(queued.id)
        wait_for(lambda: d.info().queue_depth == 1, 10, "the queued job to leave")
        # Deleting the running job stops it at its next step; the next runs.
        t0 = time.monotonic()
        assert c.videos.retrieve(long_id).status == "in_progress"
        c.videos.delete(long_id)
        done, _ = wait_video(c, small.id)
        assert done.status == "completed", done
        print(f"the deleted running job made way in {time.monotonic() - t0:.2f} s")
        assert "deleted" in d.log(), "the cancel's reason is logged"
        # Finished jobs expire after the retention: gone from status, content and list.
        assert done.expires_at == done.completed_at + 2
        assert [x.id for x in c.videos.list().data] == [small.id]
        time.sleep(max(0.0, done.expires_at - time.time()) + 1.1)
        video_error(openai.NotFoundError, lambda: c.videos.retrieve(small.id))
        video_error(openai.NotFoundError, lambda: c.videos.download_content(small.id))
        assert c.videos.list().data == []
        # Room again: three more are taken.
        ids = [c.videos.create(prompt=PROMPT, **CLIP).id for _ in range(3)]
        video_error(openai.RateLimitError, lambda: c.videos.create(prompt=PROMPT, **CLIP))
        for vid in ids:
            assert wait_video(c, vid)[0].status == "completed"
        d.stop()
    finally:
        d.close()
    # --http-video-bytes at its least, 1 MiB: two clips of about 650 KiB
    # each fit alone but not together, and one of about 1.3 MiB not at all.
    # A clip that does not fit fails with the store's own code.
    d = Daemon("--http-listen", "127.0.0.1:0", "--http-video-bytes", "1048576", model=WAN_DEMO)
    try:
        c = client(d)
        mid = {"prompt": PROMPT, "size": "256x256", "num_frames": 33, "num_inference_steps": 1}
        first, second = (json.loads(http_request(d, "POST", VIDEOS, dict(mid, seed=s))[2])["id"]
                         for s in (1, 2))
        a, _ = wait_video(c, first)
        b, _ = wait_video(c, second)
        assert a.status == "completed", a
        size_a = len(c.videos.download_content(first).read())
        assert 1048576 // 2 < size_a < 1048576, size_a
        assert b.status == "failed" and b.error.code == "video_store_full", b
        assert "--http-video-bytes" in b.error.message, b
        video_error(openai.ConflictError, lambda: c.videos.download_content(second))
        c.videos.delete(first)
        c.videos.delete(second)
        big = json.loads(http_request(d, "POST", VIDEOS, {
            "prompt": PROMPT, "size": "512x512", "num_frames": 17, "num_inference_steps": 1,
            "seed": 3})[2])["id"]
        done, _ = wait_video(c, big)
        assert done.status == "failed" and done.error.code == "video_store_full", done
        assert "larger than the store" in done.error.message, done
        # The store is empty again: a clip that fits is served.
        again = json.loads(http_request(d, "POST", VIDEOS, dict(mid, seed=1))[2])["id"]
        assert wait_video(c, again)[0].status == "completed"
        assert len(c.videos.download_content(again).read()) == size_a
        d.stop()
    finally:
        d.close()


@case
def browser_video():
    """On a video model the playground shows frames and fps, creates the
    clip through /v1/videos, drives its progress bar from the polled status
    and plays the MP4 in a <video> element at the size and length asked for."""
    import shutil
    chromedriver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not os.path.exists(chromedriver):
        print("SKIP: chromedriver is not installed (deploy/install-deps.sh installs it)")
        return 77
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    d = Daemon("--http-listen", "127.0.0.1:0", model=WAN_DEMO)
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--autoplay-policy=no-user-gesture-required"):
        opts.add_argument(a)
    for b in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.path.exists(b):
            opts.binary_location = b
    drv = webdriver.Chrome(service=Service(chromedriver), options=opts)
    try:
        drv.set_page_load_timeout(60)
        drv.get(d.http_url + "/")
        wait_for(lambda: drv.find_element(By.ID, "video_opts").is_displayed(), 10,
                 "the frames and fps inputs")
        assert drv.find_element(By.ID, "generate").text == "Generate video"
        assert drv.find_element(By.ID, "fps").get_attribute("value") == "16"

        def fill(id_, value):
            el = drv.find_element(By.ID, id_)
            el.clear()
            el.send_keys(str(value))

        fill("prompt", "a lighthouse at dusk")
        fill("width", 96)
        fill("height", 64)
        fill("frames", 17)
        fill("fps", 8)
        fill("steps", 600)
        fill("seed", 1234)
        drv.find_element(By.ID, "generate").click()
        seen = []
        t0 = time.monotonic()
        state = None
        while time.monotonic() - t0 < 120:
            p = drv.execute_script("return document.getElementById('progress').value;")
            if not seen or seen[-1] != p:
                seen.append(p)
            state = drv.execute_script(
                "const v = document.getElementById('video');"
                "return [v.readyState, v.duration, v.videoWidth, v.videoHeight, v.error && "
                "v.error.message, document.getElementById('status').textContent];")
            if state[0] >= 1 or state[4] or "HTTP" in state[5]:
                break
            time.sleep(0.02)
        # The page sets 100 before it fetches the clip, which may happen
        # between this loop's two reads: read the bar once more.
        p = drv.execute_script("return document.getElementById('progress').value;")
        if seen[-1] != p:
            seen.append(p)
        assert state and state[0] >= 1 and not state[4], (state, seen)
        assert state[1] > 0 and state[2:4] == [96, 64], state
        # 17 frames at 8 fps: within one frame.
        assert abs(state[1] - 17 / 8) <= 1 / 8, state
        # It plays: frames decode and the clock moves.
        wait_for(lambda: drv.execute_script(
            "const v = document.getElementById('video');"
            "return !v.error && v.readyState >= 2 && v.currentTime > 0;"), 20, "the clip playing")
        assert drv.find_element(By.ID, "status").text == "Done"
        assert seen == sorted(seen) and seen[-1] == 100, f"progress: {seen}"
        # Driven by the polled status: a value between the ends was shown.
        assert any(p and 0 < p < 100 for p in seen), f"progress: {seen}"
        details = drv.find_element(By.ID, "details").text
        assert "seed 1234" in details and "frames 17 at 8 fps" in details, details
        # The clip the page plays is the one the API holds.
        vid = drv.execute_script("return document.getElementById('video').dataset.id")
        st, hdrs, body = http_request(d, "GET", f"{VIDEOS}/{vid}/content")
        assert st == 200 and ditapi.mp4_info(body) == (96, 64, 17)
        # An error reaches the page (a size the form allows, the server not).
        fill("width", 4096)
        fill("height", 4096)
        drv.find_element(By.ID, "generate").click()
        wait_for(lambda: "max-pixels" in drv.find_element(By.ID, "status").text, 30,
                 "the error on the page")
        assert drv.find_element(By.ID, "status").text.startswith("HTTP 400")
        print(f"progress values seen: {seen}; duration {state[1]:.3f} s")
        d.stop()
    finally:
        drv.quit()
        d.close()


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
