#!/usr/bin/env python3
"""Generate reference ("golden") data for ditserve's FluxTransformer2DModel.

Run from anywhere (paths default to this repository's tests/data):

    python3 tests/golden/gen_flux_golden.py [--out tests/data/golden]
                                            [--demo-out tests/data/demo]
                                            [--no-demo]

Needs torch, diffusers, safetensors (CPU is enough; a run takes seconds).

What it writes
--------------
For every case in CASES, under <out>/<case_name>/:

  transformer/               diffusers `save_pretrained` output: config.json plus
                             diffusion_pytorch_model.safetensors, or, for a sharded
                             case, diffusion_pytorch_model.safetensors.index.json
                             and diffusion_pytorch_model-0000K-of-0000N.safetensors.
                             Weights are float32, bfloat16 or float16 (per case).
  inputs.safetensors         float32 tensors, named exactly like the forward()
                             arguments:
                               hidden_states          (B, S_img, in_channels)
                               encoder_hidden_states  (B, S_txt, joint_attention_dim)
                               pooled_projections     (B, pooled_projection_dim)
                               timestep               (B,)   in (0, 1); diffusers
                                                              multiplies by 1000
                               guidance               (B,)   in [1, 5]; only when
                                                              guidance_embeds
                               img_ids                (S_img, 3) = [0, row, col]
                               txt_ids                (S_txt, 3) zeros, or small
                                                              random integers
  expected.safetensors       sample      (B, S_img, patch_size^2 * out_channels)
                                         float32 output of diffusers' float32
                                         forward.
                             sample_f64  same shape, stored as float32, computed by
                                         a float64 forward of the same weights and
                                         inputs (see `exact_float64` below).
                                         Most of |sample - sample_f64| (up to
                                         ~1e-4) comes from diffusers evaluating
                                         the sinusoidal timestep/guidance
                                         embedding in float32 (arguments up to
                                         1000 * t and 1000 * guidance), not from
                                         the GEMMs or attention (~1e-6).

and <out>/manifest.json describing all cases (config, batch, token counts,
weight dtype, sharding, max |sample|, max |sample - sample_f64|).

Unless --no-demo is given it also writes a small demo model to <demo-out>/:
transformer/ (bfloat16 weights), inputs.safetensors, expected.safetensors
(same layout as a golden case).

Weights are NOT diffusers' default init: every parameter is re-drawn (see
`randomize_parameters`) so that biases, RMSNorm weights and AdaLN modulation
are all non-trivial and a wrong implementation cannot hide behind zeros or
ones.  For bfloat16/float16 cases the weights are rounded to that dtype first;
the rounded values are what is saved, and the reference forward runs in
float32 (and float64) on exactly those rounded values.

Everything is seeded, torch runs single-threaded, and each case's outputs are
removed before they are rewritten, so re-running reproduces the same files (up to
the floating point behaviour of the installed torch build).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn

import diffusers
import diffusers.models.embeddings as dm_embeddings
import diffusers.models.transformers.transformer_flux as dm_flux
from diffusers import FluxTransformer2DModel
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
)
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "golden"
DEFAULT_DEMO_OUT = REPO_ROOT / "tests" / "data" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Scale of the random parameters.  Linear weights are N(0, gain / sqrt(fan_in)),
# so a unit-variance input gives an O(1) output.  The AdaLN projections produce
# shift / scale / gate; a smaller gain keeps (1 + scale) positive-ish and the
# gates moderate, so the residual stream stays O(1) through the blocks.
LINEAR_GAIN = 1.0
ADALN_GAIN = 0.5
BIAS_STD = 0.1
RMSNORM_STD = 0.2


def _case(name, seed, *, batch, txt_tokens, grid, weights_dtype="float32", sharded=False,
          random_txt_ids=False, **config):
    """One golden case: a FluxTransformer2DModel config plus input/serialisation choices."""
    return dict(name=name, seed=seed, config=config, batch=batch, txt_tokens=txt_tokens,
                grid=grid, weights_dtype=weights_dtype, sharded=sharded,
                random_txt_ids=random_txt_ids)


# Each case is small (the whole tree stays well under 1.5 MB) and they differ
# in every knob the C implementation has to get right.  inner_dim =
# num_attention_heads * attention_head_dim; sum(axes_dims_rope) must equal
# attention_head_dim and each axis must be even.
CASES = [
    # Only the embedders and the final AdaLN + projection: isolates those parts.
    _case("no_blocks", 101, batch=1, txt_tokens=3, grid=(2, 3),
          num_layers=0, num_single_layers=0, num_attention_heads=2, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), in_channels=4, joint_attention_dim=8,
          pooled_projection_dim=6, guidance_embeds=False),
    # Two double-stream blocks, no single-stream blocks, odd token counts.
    _case("double_only", 202, batch=1, txt_tokens=7, grid=(5, 7),
          num_layers=2, num_single_layers=0, num_attention_heads=2, attention_head_dim=12,
          axes_dims_rope=(4, 4, 4), in_channels=8, joint_attention_dim=16,
          pooled_projection_dim=12, guidance_embeds=False),
    # Single-stream blocks only, one head of 16, guidance embedder, batch 2.
    _case("single_only_guidance", 303, batch=2, txt_tokens=1, grid=(3, 3),
          num_layers=0, num_single_layers=2, num_attention_heads=1, attention_head_dim=16,
          axes_dims_rope=(4, 6, 6), in_channels=16, joint_attention_dim=12,
          pooled_projection_dim=10, guidance_embeds=True),
    # patch_size 2 and out_channels != in_channels: proj_out has 2*2*8 = 32 outputs.
    _case("patch2_out8", 404, batch=1, txt_tokens=13, grid=(4, 6),
          num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), patch_size=2, in_channels=16, out_channels=8,
          joint_attention_dim=12, pooled_projection_dim=8, guidance_embeds=True),
    # Random integer txt_ids (RoPE on text tokens too), 4 heads, float16 weights.
    _case("txt_rope_f16", 505, batch=2, txt_tokens=5, grid=(4, 5), weights_dtype="float16",
          random_txt_ids=True,
          num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), in_channels=4, joint_attention_dim=20,
          pooled_projection_dim=16, guidance_embeds=False),
    # Head dim 32 with the (8, 12, 12) axis split, bfloat16 weights.
    _case("bf16_hd32", 606, batch=1, txt_tokens=6, grid=(3, 4), weights_dtype="bfloat16",
          num_layers=1, num_single_layers=1, num_attention_heads=1, attention_head_dim=32,
          axes_dims_rope=(8, 12, 12), in_channels=12, joint_attention_dim=24,
          pooled_projection_dim=8, guidance_embeds=True),
    # Full shape (2 double + 2 single), batch 2, written as a sharded checkpoint.
    _case("sharded_full", 707, batch=2, txt_tokens=4, grid=(4, 4), sharded=True,
          num_layers=2, num_single_layers=2, num_attention_heads=2, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), in_channels=8, joint_attention_dim=16,
          pooled_projection_dim=12, guidance_embeds=True),
    # For the parallel modes: 4 heads and token counts divisible by 2 and 4, so
    # every plain layout (ring/ulysses 2 and 4, tp 2 and 4, tp x cp) applies.
    _case("parallel_even", 808, batch=2, txt_tokens=8, grid=(4, 6),
          num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), in_channels=8, joint_attention_dim=16,
          pooled_projection_dim=12, guidance_embeds=True),
    # For the anything modes: 3 heads (not divisible by 2 or 4) and odd token
    # counts, so every split is uneven.
    _case("parallel_odd", 909, batch=1, txt_tokens=7, grid=(5, 7),
          num_layers=2, num_single_layers=1, num_attention_heads=3, attention_head_dim=8,
          axes_dims_rope=(2, 2, 4), in_channels=8, joint_attention_dim=12,
          pooled_projection_dim=10, guidance_embeds=False),
]

# The demo model: small, but with every block type repeated.  hidden = 2 x 16 =
# 32 keeps the bfloat16 checkpoint around 250 KB (4 heads x 16 would be ~1 MB).
DEMO = _case("demo", 4242, batch=1, txt_tokens=8, grid=(8, 8), weights_dtype="bfloat16",
             num_layers=2, num_single_layers=2, num_attention_heads=2, attention_head_dim=16,
             axes_dims_rope=(4, 6, 6), in_channels=16, joint_attention_dim=32,
             pooled_projection_dim=32, guidance_embeds=True)


# --------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------

@torch.no_grad()
def randomize_parameters(model: nn.Module, gen: torch.Generator) -> None:
    """Re-draw every parameter of `model`; fail if any parameter is not covered."""
    adaln_linears = {id(m.linear) for m in model.modules()
                     if isinstance(m, (AdaLayerNormZero, AdaLayerNormZeroSingle,
                                       AdaLayerNormContinuous))}
    touched = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            gain = ADALN_GAIN if id(module) in adaln_linears else LINEAR_GAIN
            std = gain / math.sqrt(module.in_features)
            w = module.weight
            w.copy_(torch.randn(w.shape, generator=gen) * std)
            touched.add(id(w))
            if module.bias is not None:
                b = module.bias
                b.copy_(torch.randn(b.shape, generator=gen) * BIAS_STD)
                touched.add(id(b))
        elif isinstance(module, nn.RMSNorm):  # attn.norm_q / norm_k / norm_added_q / norm_added_k
            w = module.weight
            w.copy_(1.0 + torch.randn(w.shape, generator=gen) * RMSNORM_STD)
            touched.add(id(w))
    missed = [n for n, p in model.named_parameters() if id(p) not in touched]
    if missed:
        raise RuntimeError(f"parameters not re-randomised: {missed}")


def build_model(case: dict) -> FluxTransformer2DModel:
    torch.manual_seed(case["seed"])
    model = FluxTransformer2DModel(**case["config"]).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(case["seed"])
    randomize_parameters(model, gen)
    dtype = DTYPES[case["weights_dtype"]]
    if dtype != torch.float32:
        # Round to the storage dtype and back: the float32 model now holds
        # exactly the values that end up in the checkpoint.
        model.to(dtype).to(torch.float32)
    return model


def make_inputs(case: dict) -> dict[str, torch.Tensor]:
    cfg = case["config"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    b, s_txt = case["batch"], case["txt_tokens"]
    h, w = case["grid"]
    s_img = h * w

    inputs = {
        "hidden_states": torch.randn(b, s_img, cfg["in_channels"], generator=gen),
        "encoder_hidden_states": torch.randn(b, s_txt, cfg["joint_attention_dim"], generator=gen),
        "pooled_projections": torch.randn(b, cfg["pooled_projection_dim"], generator=gen),
        "timestep": torch.rand(b, generator=gen),
    }
    if cfg.get("guidance_embeds", False):
        inputs["guidance"] = 1.0 + 4.0 * torch.rand(b, generator=gen)

    # Same layout as FluxPipeline._prepare_latent_image_ids: [0, row, col],
    # row-major over the h x w latent grid.
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h, dtype=torch.float32)[:, None]
    img_ids[..., 2] = torch.arange(w, dtype=torch.float32)[None, :]
    inputs["img_ids"] = img_ids.reshape(s_img, 3)

    if case["random_txt_ids"]:
        inputs["txt_ids"] = torch.randint(0, 8, (s_txt, 3), generator=gen).to(torch.float32)
    else:
        inputs["txt_ids"] = torch.zeros(s_txt, 3)
    return {k: v.contiguous() for k, v in inputs.items()}


# --------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------

@torch.no_grad()
def run_forward(model: FluxTransformer2DModel, inputs: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    kwargs = {k: v.to(dtype) for k, v in inputs.items()}
    return model(**kwargs, return_dict=False)[0]


def _timestep_embedding_f64(timesteps, embedding_dim, flip_sin_to_cos=False,
                            downscale_freq_shift=1, scale=1, max_period=10000):
    """diffusers' get_timestep_embedding, but evaluated in the dtype of `timesteps`
    (the original forces float32 for the frequencies and the arguments)."""
    half = embedding_dim // 2
    dt = timesteps.dtype
    exponent = -math.log(max_period) * torch.arange(half, dtype=dt) / (half - downscale_freq_shift)
    args = scale * (timesteps[:, None] * torch.exp(exponent)[None, :])
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


def _rope_1d_f64(dim, pos, theta=10000.0, **_unused):
    """Flux's 1-D RoPE table (interleaved cos/sin pairs), in float64 throughout."""
    pos = pos.to(torch.float64)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(pos, inv_freq)
    return (freqs.cos().repeat_interleave(2, dim=1),
            freqs.sin().repeat_interleave(2, dim=1))


def _apply_rope_f64(x, freqs_cis, sequence_dim=1, **_unused):
    """apply_rotary_emb for Flux (use_real, unbind dim -1) without the float32 cast."""
    cos, sin = freqs_cis
    assert sequence_dim == 1
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x_re, x_im = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rot = torch.stack([-x_im, x_re], dim=-1).flatten(3)
    return x * cos + x_rot * sin


@contextlib.contextmanager
def exact_float64():
    """Make diffusers' Flux forward genuinely float64.

    With model.double() alone, three helpers still round to float32: the
    sinusoidal timestep/guidance embedding, the RoPE cos/sin tables, and the
    RoPE application (x.float()).  Inside this context they are swapped for
    float64 versions of the same formulas, so `sample_f64` is a reference that
    carries no float32 rounding anywhere.
    """
    saved = (dm_embeddings.get_timestep_embedding, dm_flux.get_1d_rotary_pos_embed,
             dm_flux.apply_rotary_emb)
    dm_embeddings.get_timestep_embedding = _timestep_embedding_f64
    dm_flux.get_1d_rotary_pos_embed = _rope_1d_f64
    dm_flux.apply_rotary_emb = _apply_rope_f64
    try:
        yield
    finally:
        (dm_embeddings.get_timestep_embedding, dm_flux.get_1d_rotary_pos_embed,
         dm_flux.apply_rotary_emb) = saved


def forward_f64(model: FluxTransformer2DModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model64 = copy.deepcopy(model).to(torch.float64)
    with exact_float64():
        return run_forward(model64, inputs, torch.float64)


# --------------------------------------------------------------------------
# Writing a case
# --------------------------------------------------------------------------

OUTPUTS = ("transformer", "inputs.safetensors", "expected.safetensors")


def write_case(case: dict, case_dir: Path) -> dict:
    # Remove only what this script writes (stale shards included), nothing else.
    case_dir.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        path = case_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    model = build_model(case)
    inputs = make_inputs(case)

    sample = run_forward(model, inputs)
    sample_f64 = forward_f64(model, inputs)
    if not torch.isfinite(sample).all():
        raise RuntimeError(f"{case['name']}: non-finite output")

    # Save weights in the case's storage dtype.  The model already holds
    # values exactly representable in it, so this conversion is lossless.
    dtype = DTYPES[case["weights_dtype"]]
    to_save = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    save_kwargs = {"safe_serialization": True}
    if case["sharded"]:
        save_kwargs["max_shard_size"] = "20KB"
    to_save.save_pretrained(case_dir / "transformer", **save_kwargs)

    save_file(inputs, str(case_dir / "inputs.safetensors"))
    save_file({"sample": sample.contiguous(),
               "sample_f64": sample_f64.to(torch.float32).contiguous()},
              str(case_dir / "expected.safetensors"))

    # Self-check: reload the checkpoint the way a user would.  The parameters
    # must come back bit for bit (catches lossy dtype round trips and missing
    # shards); the output only to rounding, because GEMM kernels may pick a
    # different path for differently aligned (memory-mapped) weights.
    reloaded = FluxTransformer2DModel.from_pretrained(
        case_dir / "transformer", torch_dtype=torch.float32, low_cpu_mem_usage=False).eval()
    ref_sd, new_sd = model.state_dict(), reloaded.state_dict()
    if ref_sd.keys() != new_sd.keys() or not all(torch.equal(ref_sd[k], new_sd[k]) for k in ref_sd):
        raise RuntimeError(f"{case['name']}: reloaded parameters differ from the saved ones")
    err = float((run_forward(reloaded, inputs) - sample).abs().max())
    if err > 1e-5 * max(1.0, float(sample.abs().max())):
        raise RuntimeError(f"{case['name']}: reloaded checkpoint gives output off by {err}")

    files = sorted(p.name for p in (case_dir / "transformer").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    if case["sharded"] and len(shards) < 2:
        raise RuntimeError(f"{case['name']}: expected several shards, got {shards}")

    # The full resolved config (defaults included), as written to config.json.
    cfg = {k: v for k, v in model.config.items() if not k.startswith("_")}
    h, w = case["grid"]
    return {
        "name": case["name"],
        "seed": case["seed"],
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "batch": case["batch"],
        "txt_tokens": case["txt_tokens"],
        "img_tokens": h * w,
        "img_grid": [h, w],
        "random_txt_ids": case["random_txt_ids"],
        "weights_dtype": case["weights_dtype"],
        "sharded": case["sharded"],
        "weight_files": shards,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sample_shape": list(sample.shape),
        "max_abs_sample": float(sample.abs().max()),
        "max_abs_diff_f32_vs_f64": float((sample.double() - sample_f64).abs().max()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="golden case directory (default: %(default)s)")
    ap.add_argument("--demo-out", type=Path, default=DEFAULT_DEMO_OUT,
                    help="demo model directory (default: %(default)s)")
    ap.add_argument("--no-demo", action="store_true", help="do not write the demo model")
    args = ap.parse_args(argv)

    # One thread: the reductions inside GEMM/attention then do not depend on
    # the machine's core count, which keeps the fixtures reproducible.
    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()

    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "generator": "tests/golden/gen_flux_golden.py",
        "diffusers_version": diffusers.__version__,
        "torch_version": torch.__version__,
        "cases": [],
    }
    for case in CASES:
        entry = write_case(case, args.out / case["name"])
        manifest["cases"].append(entry)
        print(f"{entry['name']:22s} B={entry['batch']} txt={entry['txt_tokens']:2d} "
              f"img={entry['img_tokens']:2d} {entry['weights_dtype']:8s} "
              f"params={entry['num_parameters']:6d} max|sample|={entry['max_abs_sample']:.3f} "
              f"max|f32-f64|={entry['max_abs_diff_f32_vs_f64']:.2e}")
    with open(args.out / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")

    if not args.no_demo:
        demo_dir = args.demo_out
        entry = write_case(DEMO, demo_dir)
        print(f"demo -> {demo_dir}: params={entry['num_parameters']} "
              f"max|sample|={entry['max_abs_sample']:.3f} "
              f"max|f32-f64|={entry['max_abs_diff_f32_vs_f64']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
