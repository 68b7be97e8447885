#!/usr/bin/env python3
"""Generate reference data for ditserve's AutoencoderKLWan decoder.

Run from anywhere (paths default to this repository's tests/data/wan_vae):

    python3 tests/golden/gen_wan_vae_golden.py [--out tests/data/wan_vae]

Needs torch, diffusers, safetensors and numpy (CPU only; seconds).

What it writes, under <out>/:

  vae/               diffusers `save_pretrained` output of a tiny random
                     AutoencoderKLWan (encoder included, as a Wan repository's
                     vae/ folder holds it): config.json and
                     diffusion_pytorch_model.safetensors.
  io.safetensors     float32 tensors, for k = 1, 2, 3 latent frames:
                       latents{k}  (1, z_dim, k, h, w), non-square, what the
                                   transformer hands to the pipeline's decode
                       z{k}        latents{k} / (1 / latents_std) + latents_mean,
                                   WanPipeline's de-normalisation
                       video{k}    vae.decode(z{k}).sample, float32,
                                   (1, 3, 1 + 4 (k - 1), 8 h, 8 w), clamped
  manifest.json      config and shapes.

Every parameter is re-drawn (diffusers' init leaves biases at zero and RMS
norm scales at one), so that every piece of the decoder is exercised. torch
runs single-threaded and everything is seeded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "wan_vae"

CONFIG = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[-0.7571, 0.1075, 0.9653, -0.0715],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
)
OUT_GAIN = 0.4
# Latent (h, w) per number of latent frames: non-square, odd sides included.
SHAPES = {1: (3, 5), 2: (4, 3), 3: (2, 3)}


def randomize_parameters(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):  # WanRMS_norm scale
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        # A smaller head keeps most of the video inside the clamp to [-1, 1],
        # so that the comparison sees the decoder's values, not the bounds.
        model.decoder.conv_out.weight.mul_(OUT_GAIN)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)

    vae = AutoencoderKLWan(**CONFIG).eval()
    randomize_parameters(vae, gen)
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    vae.save_pretrained(out / "vae", safe_serialization=True)

    mean = torch.tensor(CONFIG["latents_mean"]).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(CONFIG["latents_std"]).view(1, -1, 1, 1, 1)
    tensors = {}
    manifest = {"config": CONFIG, "cases": []}
    for k, (h, w) in SHAPES.items():
        latents = torch.randn((1, CONFIG["z_dim"], k, h, w), generator=gen)
        z = latents / std + mean  # WanPipeline.__call__
        with torch.no_grad():
            video = vae.decode(z).sample.float()
        tensors[f"latents{k}"] = latents.contiguous()
        tensors[f"z{k}"] = z.contiguous()
        tensors[f"video{k}"] = video.contiguous()
        manifest["cases"].append({"frames": k, "latent_hw": [h, w], "video": list(video.shape),
                                  "min": float(video.min()), "max": float(video.max())})
    save_file(tensors, str(out / "io.safetensors"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
