#!/usr/bin/env python3
"""Wan 2.1 benchmark models, and diffusers' WanTransformer3DModel forward on the CPU.

    python3 tests/bench/bench_diffusers_wan.py --make DIR [config flags]
    python3 tests/bench/bench_diffusers_wan.py --model DIR [--threads N] [--warmup 1] [--iters 3]

--make writes a random-weight model folder for `ditrun forward` and for the
timing mode (nothing of it is committed; the mid-size default is ~400 MB):

  DIR/transformer/        save_pretrained output (config.json, f32 safetensors)
  DIR/inputs.safetensors  hidden_states (1, in_channels, F, H, W), timestep (1),
                          encoder_hidden_states (1, text_tokens, text_dim)
  DIR/expected.safetensors  sample: diffusers' f32 output (ditrun --compare)
  DIR/bench_config.json   the flags it was made with (an unchanged folder is
                          kept; --force remakes it)

Config flags (defaults: Wan 2.1 1.3B's block shape with 2 of its 30 layers,
a 17-frame 320x512 video = latent 5 x 40 x 64 = 3200 tokens, 512 text tokens):
  --heads 12 --head-dim 128 --ffn 8960 --layers 2 --in-channels 16
  --text-dim 4096 --freq-dim 256 --frames 5 --height 40 --width 64
  --text-tokens 512 --seed 0

The timing mode loads DIR's config and weights (the ones ditrun reads),
runs under torch.no_grad() in float32 and prints the environment, then

    diffusers forward: median X ms, min Y ms, Z GFLOP/s (T GFLOP), threads N, torch V

GFLOP/s from the median. The FLOP count is ditserve's dit_wan_forward_flops:
2 rows in out per Linear applied plus 4 B Sq Skv inner per attention
(self-attention over the video tokens, cross-attention to the text).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import diffusers
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file

CONFIG_FLAGS = ("heads", "head_dim", "ffn", "layers", "in_channels", "text_dim", "freq_dim",
                "frames", "height", "width", "text_tokens", "seed")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make", type=Path, metavar="DIR", help="write a model folder")
    mode.add_argument("--model", type=Path, metavar="DIR", help="time diffusers on a folder")
    ap.add_argument("--force", action="store_true", help="--make: remake an unchanged folder")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--in-channels", type=int, default=16)
    ap.add_argument("--text-dim", type=int, default=4096)
    ap.add_argument("--freq-dim", type=int, default=256)
    ap.add_argument("--frames", type=int, default=5, help="latent frames")
    ap.add_argument("--height", type=int, default=40, help="latent height")
    ap.add_argument("--width", type=int, default=64, help="latent width")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def model_config(a) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=a.heads, attention_head_dim=a.head_dim,
                in_channels=a.in_channels, out_channels=a.in_channels, text_dim=a.text_dim,
                freq_dim=a.freq_dim, ffn_dim=a.ffn, num_layers=a.layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def forward_flops(cfg: dict, batch: int, tokens: int, text: int) -> float:
    """ditserve's dit_wan_forward_flops (worker/models/wan/wan.c)."""
    c = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f = cfg["ffn_dim"]
    pt, ph, pw = cfg["patch_size"]
    patch_dim = cfg["in_channels"] * pt * ph * pw
    out_dim = cfg["out_channels"] * pt * ph * pw
    s, b, l = tokens, batch, text
    per_block = (2.0 * b * s * c * (3 * c + c + c + c + 2 * f) + 2.0 * b * l * c * 2 * c
                 + 4.0 * b * s * s * c + 4.0 * b * s * l * c)
    return (cfg["num_layers"] * per_block + 2.0 * b * s * c * (patch_dim + out_dim)
            + 2.0 * b * l * c * (cfg["text_dim"] + c))


def make(a) -> int:
    d = a.make
    stamp = {k: getattr(a, k) for k in CONFIG_FLAGS}
    stamp_path = d / "bench_config.json"
    if not a.force and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"{d}: unchanged, kept")
        return 0
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    torch.manual_seed(a.seed)
    cfg = model_config(a)
    model = WanTransformer3DModel(**cfg).eval()  # f32, diffusers' init
    gen = torch.Generator().manual_seed(a.seed + 1)
    hs = torch.randn(1, a.in_channels, a.frames, a.height, a.width, generator=gen)
    ehs = torch.randn(1, a.text_tokens, a.text_dim, generator=gen)
    t = torch.tensor([500.0])
    torch.set_num_threads(a.threads)
    with torch.no_grad():
        sample = model(hs, t, ehs, return_dict=False)[0].float().contiguous()
    model.save_pretrained(d / "transformer", safe_serialization=True, max_shard_size="10GB")
    save_file({"hidden_states": hs.contiguous(), "timestep": t,
               "encoder_hidden_states": ehs.contiguous()}, d / "inputs.safetensors")
    save_file({"sample": sample}, d / "expected.safetensors")
    stamp_path.write_text(json.dumps(stamp) + "\n")
    tokens = a.frames * (a.height // 2) * (a.width // 2)
    params = sum(p.numel() for p in model.parameters())
    print(f"{d}: {a.layers} layers, {a.heads} heads x {a.head_dim}, ffn {a.ffn}, "
          f"{params / 1e6:.1f} M parameters; latent {a.frames}x{a.height}x{a.width} = {tokens} "
          f"tokens, {a.text_tokens} text tokens; "
          f"{forward_flops(cfg, 1, tokens, a.text_tokens) / 1e9:.1f} GFLOP per forward")
    return 0


def timing(a) -> int:
    torch.set_num_threads(a.threads)
    diffusers.utils.logging.set_verbosity_error()
    # The weights ditrun reads, without from_pretrained (which needs accelerate
    # for this class's keep_in_fp32_modules); strict: every tensor is used.
    tdir = a.model / "transformer"
    model = WanTransformer3DModel.from_config(json.loads((tdir / "config.json").read_text()))
    model.load_state_dict(load_file(tdir / "diffusion_pytorch_model.safetensors"), strict=True)
    model = model.eval()
    cfg = dict(model.config)
    inputs = load_file(a.model / "inputs.safetensors")
    hs, t, ehs = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    pt, ph, pw = cfg["patch_size"]
    tokens = (hs.shape[2] // pt) * (hs.shape[3] // ph) * (hs.shape[4] // pw)
    flops = forward_flops(cfg, hs.shape[0], tokens, ehs.shape[1])
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"python {sys.version.split()[0]}, threads {torch.get_num_threads()} "
          f"(os.cpu_count() {os.cpu_count()})")
    print(f"model: {a.model} ({cfg['num_layers']} layers, {cfg['num_attention_heads']} heads x "
          f"{cfg['attention_head_dim']}, ffn {cfg['ffn_dim']}), {tokens} video + "
          f"{ehs.shape[1]} text tokens, {flops / 1e9:.1f} GFLOP per forward")

    def forward():
        with torch.no_grad():
            return model(hs, t, ehs, return_dict=False)[0]

    for _ in range(a.warmup):
        forward()
    times_ms = []
    for i in range(a.iters):
        t0 = time.perf_counter()
        out = forward()
        times_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"iter {i}: {times_ms[-1]:.1f} ms")
    assert torch.isfinite(out).all()
    ref = load_file(a.model / "expected.safetensors")["sample"]
    print(f"output vs expected.safetensors: max abs diff {(out - ref).abs().max().item():.3g}")
    median = statistics.median(times_ms)
    print(f"diffusers forward: median {median:.1f} ms, min {min(times_ms):.1f} ms, "
          f"{flops / (median * 1e-3) / 1e9:.1f} GFLOP/s ({flops / 1e9:.1f} GFLOP), "
          f"threads {a.threads}, torch {torch.__version__}")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    return make(a) if a.make else timing(a)


if __name__ == "__main__":
    sys.exit(main())
