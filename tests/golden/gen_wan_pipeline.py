#!/usr/bin/env python3
"""Generate a tiny random WanPipeline folder and whole-pipeline references.

Run from anywhere (paths default to this repository's tests/data):

    python3 tests/golden/gen_wan_pipeline.py [--out tests/data/wan_demo]

Needs torch, transformers, diffusers and safetensors (CPU; seconds).

What it writes under <out>/:

  model_index.json   WanPipeline, with the null components diffusers itself
                     writes for Wan 2.1 (transformer_2: [null, null],
                     boundary_ratio: null, expand_timesteps: false).
  transformer/       a tiny random WanTransformer3DModel (f32).
  text_encoder/      a tiny random UMT5EncoderModel (f32), vocab 1100.
  tokenizer/         a copy of the T5 unigram fixture tests/data/tokenizers/t5.
  vae/               a tiny random AutoencoderKLWan (z_dim 4, 8x spatial and
                     4x temporal compression, as Wan's).
  scheduler/         UniPCMultistepScheduler with Wan 2.1's config.
  reference.safetensors
                     float32, for every case <name> of CASES:
                       <name>.latents  (1, C, F', H/8, W/8) the pipeline's
                                       output_type='latent' result
                       <name>.video    (1, 3, F, H, W) vae.decode of the
                                       de-normalised latents, as decode
                                       returns it (before the video
                                       processor's post-processing)
  reference.json     the cases: prompt, negative prompt, sizes, frames,
                     steps, guidance, seed, max_sequence_length.

Every parameter is re-drawn (diffusers' init leaves biases at zero and norm
scales at one), so that every piece is exercised. torch runs
single-threaded and everything is seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline,
                       WanTransformer3DModel)
from safetensors.torch import save_file
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel
from transformers.models.umt5.modeling_umt5 import UMT5Attention

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "wan_demo"
TOKENIZER_DIR = REPO_ROOT / "tests" / "data" / "tokenizers" / "t5"

UMT5 = dict(vocab_size=1100, d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
            relative_attention_max_distance=12, layer_norm_epsilon=1e-6, pad_token_id=0,
            eos_token_id=1, decoder_start_token_id=0)

TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                   in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=48,
                   num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)

VAE = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True],
           latents_mean=[-0.7571, 0.1075, 0.9653, -0.0715],
           latents_std=[2.8184, 1.4541, 2.3275, 2.6558])
VAE_OUT_GAIN = 0.4

# Wan 2.1's scheduler/scheduler_config.json (flow_shift 3.0: 480p).
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                 beta_schedule="linear", solver_order=2, prediction_type="flow_prediction",
                 thresholding=False, predict_x0=True, solver_type="bh2",
                 lower_order_final=True, disable_corrector=[], use_flow_sigmas=True,
                 flow_shift=3.0, timestep_spacing="linspace", steps_offset=0,
                 final_sigmas_type="zero")

CASES = [
    # One frame (an image), CFG on with an empty negative prompt, non-square.
    dict(name="f1_cfg", prompt="a red fox in the snow", negative_prompt="", height=32,
         width=48, num_frames=1, num_inference_steps=3, guidance_scale=5.0, seed=7,
         max_sequence_length=16),
    # Five frames (two latent frames), CFG off, portrait.
    dict(name="f5_nocfg", prompt="a small boat on a lake", negative_prompt=None, height=48,
         width=32, num_frames=5, num_inference_steps=4, guidance_scale=1.0, seed=42,
         max_sequence_length=16),
    # Nine frames (three latent frames), CFG on with a negative prompt, wide.
    dict(name="f9_cfg_neg", prompt="a cat jumping over a fence",
         negative_prompt="blurry, low quality", height=32, width=64, num_frames=9,
         num_inference_steps=3, guidance_scale=4.0, seed=123, max_sequence_length=16),
    # Nine frames, CFG off, square, an odd text length.
    dict(name="f9_nocfg", prompt="waves on a beach at sunset", negative_prompt=None, height=32,
         width=32, num_frames=9, num_inference_steps=2, guidance_scale=1.0, seed=3,
         max_sequence_length=13),
]


@torch.no_grad()
def randomize(model: nn.Module, gen: torch.Generator, out_gain: dict | None = None) -> None:
    for name, p in model.named_parameters():
        if name.endswith("gamma") or name.endswith("norm.weight") or "layer_norm" in name \
                or name.endswith("norm_q.weight") or name.endswith("norm_k.weight") \
                or name.endswith("norm_added_k.weight") or "norm2.weight" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "shared" in name or "embedding" in name.lower() and p.dim() == 2 and "proj" not in name \
                and "linear" not in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for name, gain in (out_gain or {}).items():
        model.get_parameter(name).mul_(gain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2024)

    text_encoder = UMT5EncoderModel(UMT5Config(**UMT5)).eval()
    randomize(text_encoder, gen)
    # UMT5 does not scale q.k by 1/sqrt(d_kv) (see gen_text_encoder_golden.py).
    with torch.no_grad():
        for mod in text_encoder.modules():
            if isinstance(mod, UMT5Attention):
                mod.q.weight.mul_(mod.key_value_proj_dim ** -0.5)
    transformer = WanTransformer3DModel(**TRANSFORMER).eval()
    randomize(transformer, gen)
    vae = AutoencoderKLWan(**VAE).eval()
    randomize(vae, gen, {"decoder.conv_out.weight": VAE_OUT_GAIN})
    scheduler = UniPCMultistepScheduler(**SCHEDULER)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=scheduler, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)

    out = args.out
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    # The tokenizer as the fixture has it (save_pretrained re-serialises it).
    shutil.rmtree(out / "tokenizer")
    shutil.copytree(TOKENIZER_DIR, out / "tokenizer")

    mean = torch.tensor(VAE["latents_mean"]).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(VAE["latents_std"]).view(1, -1, 1, 1, 1)

    tensors = {}
    for case in CASES:
        kw = {k: v for k, v in case.items() if k not in ("name", "seed")}
        g = torch.Generator().manual_seed(case["seed"])
        with torch.no_grad():
            latents = pipe(**kw, generator=g, output_type="latent").frames
            video = pipe.vae.decode(latents / std + mean, return_dict=False)[0]
        tensors[f"{case['name']}.latents"] = latents.float().contiguous()
        tensors[f"{case['name']}.video"] = video.float().contiguous()
        case["latents_shape"] = list(latents.shape)
        case["video_shape"] = list(video.shape)
        case["video_min"] = float(video.min())
        case["video_max"] = float(video.max())
    save_file(tensors, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps({"cases": CASES}, indent=1) + "\n")


if __name__ == "__main__":
    main()
