"""End-to-end tests of text-to-video through ditd: the tiny WanPipeline of
tests/data/wan_demo served by a real ditd with real ditworker processes on
a context-parallel mesh, over real gRPC.

    test_video.py CASE      runs one case (meson registers each as a test)
    test_video.py --list    lists the cases
"""

import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import Daemon, env_path, run_cases, WAN_DEMO  # noqa: E402

CASES = {}

# diffusers' WanPipeline on the same folder (tests/golden/gen_wan_pipeline.py).
REF = os.path.join(WAN_DEMO, "reference.safetensors")
TOL = 1e-4


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def read_safetensors(path, name):
    """(shape, list of floats) of an f32 tensor, without numpy or torch."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        meta = header[name]
        assert meta["dtype"] == "F32", meta
        a, b = meta["data_offsets"]
        f.seek(8 + n + a)
        data = f.read(b - a)
    return meta["shape"], list(struct.unpack(f"<{len(data) // 4}f", data))


def rel_error(got, want):
    assert len(got) == len(want), (len(got), len(want))
    worst = max(abs(g - w) for g, w in zip(got, want))
    return worst / max(abs(w) for w in want)


def reference_case(name):
    with open(os.path.join(WAN_DEMO, "reference.json")) as f:
        return next(c for c in json.load(f)["cases"] if c["name"] == name)


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


def request_of(c, **extra):
    fields = dict(prompt=c["prompt"], width=c["width"], height=c["height"],
                  num_frames=c["num_frames"], num_inference_steps=c["num_inference_steps"],
                  guidance_scale=c["guidance_scale"], seed=c["seed"],
                  max_sequence_length=c["max_sequence_length"])
    if c["negative_prompt"] is not None:
        fields["negative_prompt"] = c["negative_prompt"]
    fields.update(extra)
    return fields


# --------------------------------------------------------------------------


@case
def generate():
    """ListModels describes a text-to-video model; a raw video from a ring x
    Ulysses mesh equals diffusers' WanPipeline; progress comes per step and
    for the decode; the default output is an H.264 MP4; ditctl writes it."""
    d = Daemon("--ring", "2", "--ulysses", "2", world=4, model=WAN_DEMO)
    try:
        models = d.api.list_models(d.channel)(
            d.api.msg("ditserve.v1.ListModelsRequest")(), timeout=10).models
        assert len(models) == 1, models
        m = models[0]
        assert m.pipeline == "WanPipeline" and m.transformer == "WanTransformer3DModel", m
        assert m.task == d.api.enum("ditserve.v1.Task", "TASK_TEXT_TO_VIDEO"), m
        assert (m.default_width, m.default_height) == (832, 480), m
        assert (m.default_num_frames, m.default_fps, m.default_steps) == (81, 16, 50), m
        assert m.layout.frame_step == 4 and m.layout.size_multiple == 16, m.layout
        assert m.config["in_channels"] == 4 and m.config["text_dim"] == 32, m.config
        assert m.config["vae_scale_factor_temporal"] == 4 and "pooled_projection_dim" not in m.config

        # 48x48 at one frame is 9 video tokens, which 4 context-parallel
        # ranks cannot split: the client hears what would work, the operator's
        # "anything" modes stay out of it.
        details = expect_error(
            lambda: d.generate(prompt="x", width=48, height=48, num_frames=1,
                               num_inference_steps=1),
            "INVALID_ARGUMENT", "a 48x48 video of 1 frame is 9 tokens",
            "multiple of 4", "nearest sizes that work: 64x48, 48x64; or num_frames 13")
        assert "anything" not in details, details

        c = reference_case("f9_cfg_neg")
        kinds, data, res = d.generate(**request_of(c, output_format="OUTPUT_FORMAT_RAW_TENSOR"))
        assert kinds.count("progress") == c["num_inference_steps"] + 1, kinds
        assert res.format == d.api.enum("ditserve.v1.OutputFormat", "OUTPUT_FORMAT_RAW_TENSOR")
        assert list(res.shape) == [3, 9, 32, 64], res.shape
        assert (res.num_frames, res.fps, res.width, res.height) == (9, 16, 64, 32), res
        got = list(struct.unpack(f"<{len(data) // 4}f", data))
        shape, want = read_safetensors(REF, "f9_cfg_neg.video")
        assert shape == [1, 3, 9, 32, 64], shape
        err = rel_error(got, want)
        print(f"ditd ring 2 x ulysses 2, f9_cfg_neg raw video vs diffusers: rel {err:.2g}")
        assert err <= TOL, err

        # The default output for video: an MP4 (ISO BMFF, 'ftyp' first).
        c5 = reference_case("f5_nocfg")
        kinds, data, res = d.generate(**request_of(c5, fps=8))
        assert res.format == d.api.enum("ditserve.v1.OutputFormat", "OUTPUT_FORMAT_MP4"), res
        assert data[4:8] == b"ftyp" and res.total_bytes == len(data), data[:16]
        assert (res.num_frames, res.fps) == (5, 8), res
        assert ditapi.mp4_info(data) == (res.width, res.height, 5), ditapi.mp4_info(data)
        assert res.timings.encode_ms > 0, res.timings

        with tempfile.TemporaryDirectory() as tmp:
            clip = os.path.join(tmp, "clip.mp4")
            p = subprocess.run([env_path("DITCTL"), "--target", d.target, "generate", "--prompt",
                                "a boat", "--width", "32", "--height", "48", "--frames", "5",
                                "--steps", "2", "--seed", "1", "-o", clip],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stdout + p.stderr
            assert re.search(r"^wrote .*clip\.mp4 \(\d+ bytes, MP4\)$", p.stdout, re.M), p.stdout
            assert "size: 32x48, 5 frames at 16 fps" in p.stdout, p.stdout
            with open(clip, "rb") as f:
                assert ditapi.mp4_info(f.read()) == (32, 48, 5)
            raw = os.path.join(tmp, "clip.safetensors")
            p = subprocess.run([env_path("DITCTL"), "--target", d.target, "generate", "--prompt",
                                "a boat", "--width", "32", "--height", "48", "--frames", "5",
                                "--steps", "2", "--seed", "1", "--raw", "-o", raw],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stdout + p.stderr
            assert "safetensors, tensor 'video'" in p.stdout, p.stdout
            shape, _ = read_safetensors(raw, "video")
            assert shape == [3, 5, 48, 32], shape
        d.stop()
    finally:
        d.close()


@case
def bad_requests():
    """Requests a WanPipeline cannot make are refused with a message naming
    what would work, and the daemon keeps serving."""
    d = Daemon("--max-video-pixels", "20000", model=WAN_DEMO)
    small = dict(prompt="x", width=32, height=32, num_frames=1, num_inference_steps=1)
    try:
        gen = lambda **kw: d.generate(**{**small, **kw})  # noqa: E731
        expect_error(lambda: gen(num_frames=4), "INVALID_ARGUMENT", "num_frames 4",
                     "4 x k + 1")
        expect_error(lambda: gen(num_frames=5, output_format="OUTPUT_FORMAT_PNG"),
                     "INVALID_ARGUMENT", "OUTPUT_FORMAT_PNG holds one image",
                     "OUTPUT_FORMAT_MP4")
        expect_error(lambda: gen(fps=500), "INVALID_ARGUMENT", "fps 500")
        expect_error(lambda: gen(width=40), "INVALID_ARGUMENT", "width 40", "multiple of 16")
        expect_error(lambda: gen(true_cfg_scale=3.0), "INVALID_ARGUMENT",
                     "WanPipeline guides with guidance_scale")
        expect_error(lambda: gen(prompt_2="y"), "INVALID_ARGUMENT", "one text encoder")
        # The server's own limits: pixels per video, and raw results that
        # would not fit one worker message (13 frames of 2048x2048 in f32).
        expect_error(lambda: gen(width=64, height=64, num_frames=9), "INVALID_ARGUMENT",
                     "9 frames of 64x64 are 36864 pixels", "--max-video-pixels")
        d2 = Daemon(model=WAN_DEMO)
        try:
            expect_error(lambda: d2.generate(prompt="x", width=2048, height=2048, num_frames=13,
                                             output_format="OUTPUT_FORMAT_RAW_TENSOR"),
                         "INVALID_ARGUMENT", "the raw tensor of this request would be 654311424 "
                         "bytes", "or for MP4")
            d2.stop()
        finally:
            d2.close()
        one = struct.pack("<f", 0.5)
        expect_error(lambda: gen(pooled_prompt_embeds=("DTYPE_F32", [1, 1], one)),
                     "INVALID_ARGUMENT", "no pooled text embeddings")
        # Own embeddings of 8 tokens with CFG and a text negative prompt:
        # diffusers would encode the negative at 512 tokens; refused, with
        # what works instead.
        emb = ("DTYPE_F32", [1, 8, 32], struct.pack("<256f", *([0.25] * 256)))
        expect_error(lambda: gen(prompt_embeds=emb, guidance_scale=5.0, negative_prompt="blur"),
                     "INVALID_ARGUMENT", "send negative_prompt_embeds too",
                     "max_sequence_length (512)")
        kinds, data, res = gen(prompt_embeds=emb, guidance_scale=5.0, negative_prompt_embeds=emb)
        assert res.num_frames >= 1, res
        lat = struct.pack("<16f", *([0.1] * 16))
        expect_error(lambda: gen(latents=("DTYPE_F32", [1, 4, 1, 2, 2], lat)),
                     "INVALID_ARGUMENT", "latents must have shape (1, 4, 1, 4, 4)")
        # Still serving: a one-frame request in PNG, and initial latents of
        # the right shape.
        kinds, data, res = gen(output_format="OUTPUT_FORMAT_PNG")
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and res.num_frames == 1, res
        lat = struct.pack("<64f", *([0.1] * 64))
        kinds, data, res = gen(latents=("DTYPE_F32", [1, 4, 1, 4, 4], lat),
                               output_format="OUTPUT_FORMAT_RAW_TENSOR")
        assert list(res.shape) == [3, 1, 32, 32], res.shape
        # Warmup takes the frame count too, with the same rules.
        warm = lambda **kw: d.api.warmup(d.channel)(  # noqa: E731
            d.api.msg("ditserve.v1.WarmupRequest")(**kw), timeout=120)
        expect_error(lambda: warm(width=32, height=32, num_frames=6), "INVALID_ARGUMENT",
                     "num_frames 6")
        assert warm(width=32, height=32, num_frames=5, num_inference_steps=1).elapsed_ms > 0
        # A negative prompt with guidance 1 does nothing: a warning.
        kinds, data, res = gen(negative_prompt="blurry", guidance_scale=1.0)
        assert any("guidance_scale above 1" in w for w in res.warnings), res.warnings
        d.stop()
    finally:
        d.close()


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
