#!/usr/bin/env python3
"""Write Wan 2.1's AutoencoderKLWan with random weights for bench_wan_vae.

    python3 tests/bench/make_wan_vae.py DIR [--seed 0]

DIR/config.json and DIR/diffusion_pytorch_model.safetensors (f32, ~500 MB,
encoder included; not committed). The config is Wan2.1-T2V's vae/config.json:
base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], num_res_blocks 2, attn_scales [],
temperal_downsample [False, True, True], with its latents_mean/std. Weights
are diffusers' default init (values do not change the time or memory of a
decode). An existing folder made with the same seed is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    stamp = a.dir / "bench_seed.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": a.seed}:
        print(f"{a.dir}: unchanged, kept")
        return 0
    torch.manual_seed(a.seed)
    vae = AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           attn_scales=[], temperal_downsample=[False, True, True])
    vae.save_pretrained(a.dir, safe_serialization=True)
    stamp.write_text(json.dumps({"seed": a.seed}) + "\n")
    n_dec = sum(p.numel() for n, p in vae.named_parameters()
                if n.startswith(("decoder.", "post_quant_conv.")))
    print(f"{a.dir}: AutoencoderKLWan, {sum(p.numel() for p in vae.parameters()) / 1e6:.1f} M "
          f"parameters ({n_dec / 1e6:.1f} M in the decoder)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
