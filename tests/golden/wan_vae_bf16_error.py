#!/usr/bin/env python3
"""How far diffusers' own AutoencoderKLWan decode moves when its operands are
bf16, as the cuda backend's are: the size of error a correct cuda VAE has.

    python3 tests/golden/wan_vae_bf16_error.py [tests/data/wan_vae]

Needs torch, diffusers and safetensors (CPU; seconds). Reads the tiny random
VAE and the references of gen_wan_vae_golden.py, decodes each case in f32
(which must match the reference to ~1e-6) and again with every parameter
rounded to bf16 and every convolution input rounded to bf16, sums in f32:
what the cuda backend does (bf16 weights, im2col in bf16, f32 GEMM sums).
Prints each case's max abs error against the f32 reference and that over
max|reference|, the figure tests/gpu/test_cuda_wan.c reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "tests" / "data" / "wan_vae"
    torch.set_num_threads(1)
    vae = AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=torch.float32).eval()
    io = load_file(root / "io.safetensors")

    def decode(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return vae.decode(z).sample.clamp(-1, 1)

    cases = (1, 2, 3)
    for k in cases:
        err = (decode(io[f"z{k}"]) - io[f"video{k}"]).abs().max().item()
        print(f"f32 decode, {k} latent frames: max abs {err:.3g} against the reference")
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(to_bf16(p))
    conv2d, conv3d = F.conv2d, F.conv3d
    F.conv2d = lambda x, w, *a, **kw: conv2d(to_bf16(x), w, *a, **kw)
    F.conv3d = lambda x, w, *a, **kw: conv3d(to_bf16(x), w, *a, **kw)
    for k in cases:
        ref = io[f"video{k}"]
        err = (decode(io[f"z{k}"]) - ref).abs().max().item()
        top = ref.abs().max().item()
        print(f"bf16 operands, {k} latent frames: max abs {err:.3g}, max|ref| {top:.3g}, "
              f"rel {err / top:.3g}")


if __name__ == "__main__":
    main()
