#!/usr/bin/env python3
"""Generate reference ("golden") data for ditserve's WanTransformer3DModel.

    python3 tests/golden/gen_wan_golden.py [--out tests/data/wan_golden]

Needs torch, diffusers, safetensors (CPU; a run takes seconds).

For every case in CASES, under <out>/<case_name>/:

  transformer/          diffusers `save_pretrained` output (config.json and one
                        or, for a sharded case, several safetensors files with
                        their index), weights float32 or bfloat16.
  inputs.safetensors    float32 tensors named like the forward() arguments:
                          hidden_states          (B, in_channels, F, H, W)
                          timestep               (B,) integers in [0, 1000), as
                                                 WanPipeline passes them
                          encoder_hidden_states  (B, L, text_dim)
  expected.safetensors  sample (B, out_channels, F, H, W): diffusers' float32
                        forward (model.float(), single-threaded).

Every parameter is re-drawn (biases, norm weights and the modulation tables
non-trivial). For bfloat16 cases the weights are rounded first and the
reference runs in float32 on exactly the rounded values.

The image-conditioned (i2v) path (image_dim, added_kv_proj_dim) is not
covered: a case that sets it is refused.
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from diffusers import WanTransformer3DModel
from diffusers.utils import logging as dlogging
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "wan_golden"


def _case(name, seed, *, batch, frames, height, width, txt_tokens, weights_dtype="float32",
          sharded=False, **config):
    return dict(name=name, seed=seed, config=config, batch=batch, frames=frames, height=height,
                width=width, txt_tokens=txt_tokens, weights_dtype=weights_dtype, sharded=sharded)


BASE = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
            out_channels=4, text_dim=12, freq_dim=32, ffn_dim=48, num_layers=1,
            cross_attn_norm=True, rope_max_seq_len=64)

CASES = [
    # One latent frame (an image), odd token grid 3 x 5.
    _case("one_frame", 11, batch=1, frames=1, height=6, width=10, txt_tokens=5, **BASE),
    # Several frames, one head of 32 (rope split 12/10/10), 16 channels.
    _case("frames3_hd32", 22, batch=1, frames=3, height=6, width=6, txt_tokens=7,
          **{**BASE, "num_attention_heads": 1, "attention_head_dim": 32, "in_channels": 16, "out_channels": 16,
             "freq_dim": 64, "ffn_dim": 32}),
    # Batch 2, bfloat16 weights, no cross-attention norm, out_channels != in.
    _case("bf16_batch2", 33, batch=2, frames=2, height=4, width=6, txt_tokens=3,
          weights_dtype="bfloat16",
          **{**BASE, "cross_attn_norm": False, "out_channels": 8}),
    # Sharded checkpoint, three heads, temporal patch 2.
    _case("sharded_pt2", 44, batch=1, frames=4, height=4, width=4, txt_tokens=4, sharded=True,
          **{**BASE, "num_attention_heads": 3, "attention_head_dim": 8, "patch_size": (2, 2, 2),
             "num_layers": 2}),
    # Five frames, odd grid 5 x 3, freq_dim 256 (the real models').
    _case("frames5_odd", 55, batch=1, frames=5, height=10, width=6, txt_tokens=6,
          **{**BASE, "freq_dim": 256}),
    # For the parallel modes: 4 heads, 2 x 4 x 6 = 48 tokens.
    _case("parallel_even", 66, batch=1, frames=2, height=8, width=12, txt_tokens=8,
          **{**BASE, "num_attention_heads": 4, "attention_head_dim": 8, "num_layers": 2}),
    # For the anything modes: 3 heads, 3 x 3 x 5 = 45 tokens.
    _case("parallel_odd", 77, batch=1, frames=3, height=6, width=10, txt_tokens=5,
          **{**BASE, "num_attention_heads": 3, "attention_head_dim": 8, "num_layers": 2}),
]


@torch.no_grad()
def randomize_parameters(model: nn.Module, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("scale_shift_table"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        elif p.ndim >= 2:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make_case(case, out: Path) -> None:
    cfg = case["config"]
    if cfg.get("image_dim") is not None or cfg.get("added_kv_proj_dim") is not None:
        raise SystemExit(f"{case['name']}: the image-conditioned (i2v) path is not covered")
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    model = WanTransformer3DModel(**cfg).eval()
    randomize_parameters(model, gen)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["weights_dtype"]]
    # Round the parameters only, then compute in f32 on the rounded values.
    # (model.to(bf16) would also round the f64 RoPE buffers, which
    # from_pretrained keeps as they are.)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())

    B, F, H, W = case["batch"], case["frames"], case["height"], case["width"]
    hs = torch.randn(B, cfg["in_channels"], F, H, W, generator=gen)
    ehs = torch.randn(B, case["txt_tokens"], cfg["text_dim"], generator=gen)
    t = torch.randint(0, 1000, (B,), generator=gen)
    with torch.no_grad():
        sample = model(hs, t, ehs, return_dict=False)[0].float().contiguous()

    d = out / case["name"]
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    copy.deepcopy(model).to(dtype).save_pretrained(d / "transformer", safe_serialization=True,
                         max_shard_size="25KB" if case["sharded"] else "10GB")
    save_file({"hidden_states": hs.contiguous(), "timestep": t.float(),
               "encoder_hidden_states": ehs.contiguous()}, d / "inputs.safetensors")
    save_file({"sample": sample}, d / "expected.safetensors")
    print(f"{case['name']}: sample {tuple(sample.shape)} max|x| {sample.abs().max():.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dlogging.set_verbosity_error()  # the f32 round trip of bf16 weights is deliberate
    for case in CASES:
        make_case(case, args.out)


if __name__ == "__main__":
    main()
