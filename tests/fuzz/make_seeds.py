#!/usr/bin/env python3
"""Writes the binary seed inputs of the fuzz targets (tests/fuzz/corpus/):
GenerateRequest messages for fuzz_request and IPC frames for fuzz_join,
encoded with the real .proto files (protoc makes their descriptor set), so
the mutations start from messages the daemon reads in practice, and small
safetensors files for fuzz_safetensors, and JSON bodies for fuzz_openai
(and the other JSON-fed targets). The text seeds (prompts, log
fields) are kept as written.

    python3 tests/fuzz/make_seeds.py  # rewrites corpus/{request,join,safetensors,...}

Needs protoc and python3-protobuf (deploy/install-deps.sh installs both)."""

import base64
import json
import os
import struct
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def messages():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "all.desc")
        subprocess.run(["protoc", "-I", os.path.join(ROOT, "proto"), "-I", "/usr/include",
                        "--include_imports", "--descriptor_set_out=" + out,
                        "ditserve/v1/generation.proto", "ditserve/ipc/ipc.proto"], check=True)
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)

    def cls(name):
        d = pool.FindMessageTypeByName(name)
        if hasattr(message_factory, "GetMessageClass"):
            return message_factory.GetMessageClass(d)
        return message_factory.MessageFactory(pool).GetPrototype(d)

    return cls


def write(folder, name, data):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def f32_tensor(t, shape):
    n = 1
    for s in shape:
        n *= s
    t.dtype = 1  # DTYPE_F32
    t.shape.extend(shape)
    t.data = struct.pack("<%df" % n, *[((i * 37) % 19 - 9) / 10 for i in range(n)])


def request_seeds(cls, folder):
    Req = cls("ditserve.v1.GenerateRequest")

    r = Req(prompt="a lighthouse", width=256, height=256, num_inference_steps=8)
    r.seed.value = 1
    write(folder, "plain.pb", r.SerializeToString())

    r = Req(prompt="a cat", negative_prompt="blurry", width=64, height=48,
            num_inference_steps=2, request_id="req-1", priority=3, num_images=2,
            max_sequence_length=32, output_format=2)
    r.true_cfg_scale.value = 4.0
    r.guidance_scale.value = 3.5
    write(folder, "true_cfg.pb", r.SerializeToString())

    # The demo FLUX pipeline: joint_attention_dim 32, pooled_projection_dim 32.
    r = Req(width=32, height=32, num_inference_steps=1)
    f32_tensor(r.prompt_embeds, [1, 8, 32])
    f32_tensor(r.pooled_prompt_embeds, [1, 32])
    f32_tensor(r.latents, [1, 16, 16])
    write(folder, "embeds.pb", r.SerializeToString())

    r = Req(prompt="x", model="demo", prompt_2="t5 side", negative_prompt_2="n2")
    lora = r.loras.add()
    lora.name = "style_a"
    lora.scale = 0.8
    lora = r.loras.add()
    lora.name = "b.v2-1"
    lora.scale = -1.5
    write(folder, "loras.pb", r.SerializeToString())

    # The Wan demo pipeline: frames 4k + 1, text_dim 32.
    r = Req(prompt="waves", negative_prompt="still", width=64, height=64, num_frames=5, fps=8,
            num_inference_steps=2, output_format=3)
    r.guidance_scale.value = 5.0
    write(folder, "video.pb", r.SerializeToString())

    # Found by fuzz_request: the Wan frame-count message overflowed an int.
    r = Req(prompt="waves", width=64, height=64, num_frames=(1 << 31) - 1)
    write(folder, "wan_frames_overflow.pb", r.SerializeToString())

    # A newer client's fields (999 at the top, 1000 inside a LoraUse), which
    # ditd drops on arrival.
    def varint(v):
        out = b""
        while v > 0x7f:
            out += bytes([v & 0x7f | 0x80])
            v >>= 7
        return out + bytes([v])

    def field(number, data):
        return varint(number << 3 | 2) + varint(len(data)) + data
    lu = cls("ditserve.v1.LoraUse")(name="style_a", scale=0.5).SerializeToString()
    body = Req(prompt="x", width=64, height=64).SerializeToString()
    body += field(23, lu + field(1000, b"newer")) + field(999, b"j" * 100)
    write(folder, "unknown_fields.pb", body)

    r = Req(width=-16, height=1 << 30, num_inference_steps=100000, num_images=-1,
            max_sequence_length=1 << 20, num_frames=-3, fps=-1, priority=-(1 << 31))
    r.guidance_scale.value = float("nan")
    r.seed.value = (1 << 64) - 1
    write(folder, "out_of_range.pb", r.SerializeToString())


def frame(env):
    body = env.SerializeToString()
    return struct.pack("<I", len(body)) + body


def join_seeds(cls, folder):
    Env = cls("ditserve.ipc.Envelope")
    e = Env()
    e.join.protocol = 1
    e.join.nonce = bytes(range(32))
    e.join.mac = bytes(range(32, 64))
    e.join.rank = -1
    e.join.host_id = "node-7 1b2c3d4e-boot"
    e.join.pid = 4242
    good = frame(e)
    write(folder, "join.bin", good)

    e2 = Env()
    e2.CopyFrom(e)
    e2.join.rank = 3
    e2.join.protocol = 2
    e2.join.nonce = b"short"
    write(folder, "join_bad_fields.bin", frame(e2))

    h = Env()
    h.hello.SetInParent()
    write(folder, "hello.bin", frame(h))
    write(folder, "empty_envelope.bin", frame(Env()))
    write(folder, "two_frames.bin", good + good)
    write(folder, "huge_length.bin", struct.pack("<I", 0xFFFFFFF0) + good[4:])


def safetensors(tensors, metadata=None):
    """tensors: name -> (dtype, shape, raw bytes), laid out in name order."""
    header, data = {}, b""
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as writers pad it
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds(folder):
    f32 = lambda *v: struct.pack("<%df" % len(v), *v)
    write(folder, "f32.safetensors", safetensors({"w": ("F32", [2, 3], f32(1, -2, 3.5, 0, 1e-3, 7))}))
    write(folder, "mixed.safetensors", safetensors({
        "a.weight": ("BF16", [2, 2], bytes([0x80, 0x3f, 0x00, 0xc0, 0x49, 0x40, 0x00, 0x00])),
        "a.bias": ("F16", [3], bytes([0x00, 0x3c, 0x00, 0xbc, 0x00, 0x7c])),
        "b.weight": ("F8_E4M3", [2, 4], bytes([0x38, 0xb8, 0x7e, 0x00, 0x01, 0x40, 0x7f, 0xff])),
        "b.weight_scale": ("F32", [], f32(0.25)),
        "empty": ("F32", [0, 5], b""),
    }, {"format": "pt", "lora_alpha": "8"}))
    write(folder, "scalar_only.safetensors", safetensors({"s": ("F32", [1, 1], f32(2.0))}))
    write(folder, "empty_header.safetensors", safetensors({}))


def tokenizer_seeds(folder):
    """fuzz_tokenizer's modes: 0 a raw charsmap, 1 a T5 tokenizer.json, 2 a
    CLIP one, from the fixtures."""
    data = os.path.join(ROOT, "tests", "data")
    with open(os.path.join(data, "tokenizers", "t5", "tokenizer.json"), "rb") as f:
        t5 = json.load(f)
    write(folder, "t5_charsmap.bin",
          b"\x00" + base64.b64decode(t5["normalizer"]["precompiled_charsmap"]))
    # A trie of one unit, and a size that does not fit.
    write(folder, "t5_charsmap_tiny.bin", b"\x00" + struct.pack("<II", 4, 0) + b"a\x00")
    write(folder, "t5_charsmap_bad_size.bin", b"\x00" + struct.pack("<II", 4096, 0))
    small = dict(t5)
    small["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "  "}, "content": " "}, {"type": "Strip",
                                                                        "strip_left": True,
                                                                        "strip_right": True}]}
    write(folder, "t5_replace_strip.bin", b"\x01" + json.dumps(small).encode())
    with open(os.path.join(data, "demo", "tokenizer", "tokenizer.json"), "rb") as f:
        write(folder, "clip.bin", b"\x02" + f.read())


def config_seeds(folder):
    """fuzz_config: 0 + a config for the demo FLUX weights, 1 + one for the
    demo Wan weights; the real ones, and variants that keep the weights'
    shapes (heads x head_dim) or break the rules between fields."""
    data = os.path.join(ROOT, "tests", "data")
    with open(os.path.join(data, "demo", "transformer", "config.json")) as f:
        flux = json.load(f)
    with open(os.path.join(data, "wan_demo", "transformer", "config.json")) as f:
        wan = json.load(f)
    write(folder, "flux.bin", b"\x00" + json.dumps(flux).encode())
    write(folder, "wan.bin", b"\x01" + json.dumps(wan).encode())
    swapped = dict(flux, num_attention_heads=4, attention_head_dim=8, axes_dims_rope=[2, 3, 3])
    write(folder, "flux_heads_swapped.bin", b"\x00" + json.dumps(swapped).encode())
    huge = dict(flux, num_attention_heads=1 << 20, attention_head_dim=1 << 20,
                axes_dims_rope=[1 << 20, 1 << 20, 1 << 20])
    write(folder, "flux_huge.bin", b"\x00" + json.dumps(huge).encode())
    # Weights that cannot be allocated (65536 heads of 16: inner width 2^20,
    # the largest config.json may ask for): the error path of
    # flux_alloc, which freed the plan twice.
    write(folder, "flux_weights_too_large.bin", b"\x00" + json.dumps(
        dict(flux, num_attention_heads=1 << 16)).encode())
    write(folder, "wan_swapped.bin", b"\x01" + json.dumps(
        dict(wan, num_attention_heads=1, attention_head_dim=32, patch_size=[1, 1, 4])).encode())


def openai_seeds(folder):
    """fuzz_openai: 0 + an images body, 1 + a videos JSON body, 3 + a videos
    body sent as a form (each value as its text)."""
    images = {
        "model": "demo", "prompt": "a lighthouse at dusk", "negative_prompt": "blurry",
        "n": 2, "size": "256x128", "response_format": "b64_json", "output_format": "png",
        "stream": True, "partial_images": 0, "user": "u-1", "seed": 42,
        "num_inference_steps": 8, "guidance_scale": 3.5, "true_cfg_scale": 4.0,
        "priority": -3, "loras": [{"name": "style.v1", "scale": 0.75}, {"name": "b"}]}
    write(folder, "images_min.bin", b"\x00" + json.dumps({"prompt": "a lighthouse"}).encode())
    write(folder, "images_full.bin", b"\x00" + json.dumps(images).encode())
    write(folder, "images_auto.bin", b"\x00" + json.dumps(
        {"prompt": "caf\u00e9 \u2615", "size": "auto", "n": 8}).encode())
    video = {
        "model": "wan_demo", "prompt": "a paper boat", "negative_prompt": "", "seconds": "1.5",
        "size": "64x48", "seed": 7, "num_inference_steps": 4, "guidance_scale": 5,
        "priority": 2, "fps": 12, "user": "u-2", "loras": [{"name": "wan-a", "scale": -1}]}
    # Values at the edges of their ranges (the mutator's "old value +- 2"
    # then crosses them).
    write(folder, "images_edges.bin", b"\x00" + json.dumps(
        {"prompt": "x", "n": 8, "size": "999999x1", "seed": 9007199254740981,
         "num_inference_steps": 1000, "guidance_scale": 100, "true_cfg_scale": 0,
         "priority": 1000000, "loras": [{"name": "a", "scale": -100}]}).encode())
    write(folder, "video_edges.bin", b"\x01" + json.dumps(
        {"prompt": "y", "num_frames": 100000, "fps": 240, "seed": 9007199254740991,
         "num_inference_steps": 1, "priority": -1000000, "guidance_scale": 0}).encode())
    write(folder, "video_min.bin", b"\x01" + json.dumps({"prompt": "a paper boat"}).encode())
    write(folder, "video_full.bin", b"\x01" + json.dumps(video).encode())
    write(folder, "video_frames.bin", b"\x01" + json.dumps(
        {"prompt": "waves", "num_frames": 21, "fps": 240, "seconds": 600}).encode())
    write(folder, "video_form.bin", b"\x03" + json.dumps(video).encode())
    write(folder, "video_form_frames.bin", b"\x03" + json.dumps(
        {"prompt": "waves", "num_frames": "9", "seed": "12", "guidance_scale": "1e1"}).encode())


def main():
    openai_seeds(os.path.join(HERE, "corpus", "openai"))
    config_seeds(os.path.join(HERE, "corpus", "config"))
    tokenizer_seeds(os.path.join(HERE, "corpus", "tokenizer"))
    safetensors_seeds(os.path.join(HERE, "corpus", "safetensors"))
    cls = messages()
    request_seeds(cls, os.path.join(HERE, "corpus", "request"))
    join_seeds(cls, os.path.join(HERE, "corpus", "join"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
