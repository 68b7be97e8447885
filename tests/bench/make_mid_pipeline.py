#!/usr/bin/env python3
"""Makes a mid-size FluxPipeline folder for the serving benchmarks: the demo
pipeline's text encoders, tokenizers, scheduler and VAE, with a bigger
FluxTransformer2DModel of random weights (diffusers' default init).

    python3 tests/bench/make_mid_pipeline.py OUT [--heads 8] [--head-dim 64]
                                                [--double 2] [--single 4]

The defaults are the config of `build/tests/bench_parallel` (hidden 512 =
8 heads x 64, 2 double-stream + 4 single-stream blocks), with the demo's
widths where the other components fix them (joint_attention_dim and
pooled_projection_dim 32, in_channels 16). Values do not matter for speed.
Needs torch and diffusers.
"""

import argparse
import json
import os
import shutil
import sys

import torch
from diffusers import FluxTransformer2DModel


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    a = ap.parse_args()
    demo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "demo")
    with open(os.path.join(demo, "transformer", "config.json")) as f:
        base = json.load(f)
    if a.head_dim % 16:
        sys.exit("--head-dim must be a multiple of 16 (three even rotary axes)")
    axes = [a.head_dim // 4, 3 * a.head_dim // 8, 3 * a.head_dim // 8]
    assert sum(axes) == a.head_dim and all(x % 2 == 0 for x in axes), axes
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=base["in_channels"], num_layers=a.double,
        num_single_layers=a.single, attention_head_dim=a.head_dim,
        num_attention_heads=a.heads, joint_attention_dim=base["joint_attention_dim"],
        pooled_projection_dim=base["pooled_projection_dim"],
        guidance_embeds=base["guidance_embeds"], axes_dims_rope=axes)
    os.makedirs(a.out, exist_ok=True)
    for item in os.listdir(demo):
        src, dst = os.path.join(demo, item), os.path.join(a.out, item)
        if item == "transformer":
            continue
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy(src, dst)
    model.save_pretrained(os.path.join(a.out, "transformer"))
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.out}: FluxTransformer2DModel hidden {a.heads * a.head_dim} "
          f"({a.heads} x {a.head_dim}), {a.double} double + {a.single} single blocks, "
          f"{n / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
