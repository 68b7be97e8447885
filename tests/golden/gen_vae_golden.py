#!/usr/bin/env python3
"""Generate reference data for ditserve's AutoencoderKL decoder and PNG output.

Run from anywhere (paths default to this repository's tests/data/vae):

    python3 tests/golden/gen_vae_golden.py [--out tests/data/vae]

Needs torch, diffusers, safetensors, numpy and Pillow (CPU only; seconds).

What it writes
--------------
For every case in CASES, under <out>/<case>/:

  vae/                 diffusers `save_pretrained` output of a small random
                       AutoencoderKL: config.json and
                       diffusion_pytorch_model.safetensors.  The checkpoint holds
                       the whole model, encoder included, exactly as a FLUX
                       repository's vae/ folder does.
  io.safetensors       float32 tensors:
                         z0      (1, latent_channels, h0, w0)
                         image0  (1, 3, 8*h0, 8*w0 or whatever the scale is)
                         z1      (2, latent_channels, h1, w1)
                         image1  (2, 3, ...)
                       z is what FluxPipeline hands to vae.decode, i.e. already
                       latents / scaling_factor + shift_factor; image is
                       vae.decode(z).sample from diffusers' float32 forward.
  expected.png         (only where a case sets png=True) image0[0] through
                       VaeImageProcessor.postprocess(output_type="pil"), saved
                       by PIL: the pixels FluxPipeline would return.

and <out>/postprocess/:

  postprocess.safetensors  x (1, 3, 24, 32) float32: crafted VAE outputs —
                           values whose (x * 0.5 + 0.5) * 255 is exactly k + 0.5
                           in float32 (round-half-to-even ties), their float32
                           neighbours, values outside [-1, 1], +-inf, and
                           uniform randoms.
  postprocess.png          VaeImageProcessor.postprocess(x, "pil")[0], saved by PIL.

plus <out>/manifest.json (configs, shapes, output ranges).

Weights are not diffusers' default init: every parameter is re-drawn (see
`randomize_parameters`) so that GroupNorm affines, biases and the attention
are all non-trivial.  For bfloat16/float16 cases the weights are rounded to
that dtype first, and the reference forward runs in float32 on exactly the
rounded values.  torch runs single-threaded and everything is seeded.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import diffusers
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "vae"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BIAS_STD = 0.1
NORM_STD = 0.2   # GroupNorm weight = 1 + N(0, NORM_STD)
QK_GAIN = 2.0    # sharper attention than a uniform average
OUT_GAIN = 0.6   # conv_out: keeps most of the image inside [-1, 1], some outside


def _case(name, seed, *, res0, res1, weights_dtype="float32", png=False, **config):
    n = len(config["block_out_channels"])
    config.setdefault("down_block_types", ("DownEncoderBlock2D",) * n)
    config.setdefault("up_block_types", ("UpDecoderBlock2D",) * n)
    return dict(name=name, seed=seed, config=config, res0=res0, res1=res1,
                weights_dtype=weights_dtype, png=png)


# Small enough that the whole tree stays under ~1 MB, different in every knob
# the decoder reads.
CASES = [
    # FLUX's VAE in miniature: four blocks (scale 8), 16 latent channels,
    # layers_per_block 2, no quant convs, shift_factor set, bf16 weights.
    _case("flux_like", 11, res0=(3, 5), res1=(4, 3), weights_dtype="bfloat16", png=True,
          block_out_channels=(8, 8, 16, 16), layers_per_block=2, latent_channels=16,
          norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
          scaling_factor=0.3611, shift_factor=0.1159),
    # SD-style: post_quant_conv, shift_factor null, channel counts that change
    # in two places (conv_shortcut), one-channel groups, f32 weights.
    _case("sd_like", 22, res0=(4, 4), res1=(3, 5),
          block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=4,
          norm_num_groups=8, use_quant_conv=True, use_post_quant_conv=True,
          scaling_factor=0.18215),
    # No mid-block attention, decreasing channels (16 -> 8 upwards means the
    # shortcut widens), post_quant_conv without quant_conv, f16 weights.
    _case("no_attn_f16", 33, res0=(5, 3), res1=(2, 6), weights_dtype="float16",
          block_out_channels=(16, 8), layers_per_block=1, latent_channels=8,
          norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=True,
          mid_block_add_attention=False, scaling_factor=0.5, shift_factor=-0.25),
]


@torch.no_grad()
def randomize_parameters(model: AutoencoderKL, gen: torch.Generator) -> None:
    """Re-draw every parameter of `model`; fail if any parameter is not covered."""
    touched = set()
    qk = {id(m) for name, m in model.named_modules()
          if name.endswith(".to_q") or name.endswith(".to_k")}

    def draw(p, t):
        p.copy_(t)
        touched.add(id(p))

    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            w = module.weight
            fan_in = w[0].numel()
            gain = 1.0
            if id(module) in qk:
                gain = QK_GAIN
            elif name == "decoder.conv_out":
                gain = OUT_GAIN
            draw(w, torch.randn(w.shape, generator=gen) * (gain / math.sqrt(fan_in)))
            if module.bias is not None:
                draw(module.bias, torch.randn(module.bias.shape, generator=gen) * BIAS_STD)
        elif isinstance(module, nn.GroupNorm):
            draw(module.weight, 1.0 + torch.randn(module.weight.shape, generator=gen) * NORM_STD)
            draw(module.bias, torch.randn(module.bias.shape, generator=gen) * BIAS_STD)
    missed = [n for n, p in model.named_parameters() if id(p) not in touched]
    if missed:
        raise RuntimeError(f"parameters not re-randomised: {missed}")


def build_model(case: dict) -> AutoencoderKL:
    torch.manual_seed(case["seed"])
    model = AutoencoderKL(**case["config"]).to(torch.float32).eval()
    randomize_parameters(model, torch.Generator().manual_seed(case["seed"]))
    dtype = DTYPES[case["weights_dtype"]]
    if dtype != torch.float32:
        # Round to the storage dtype and back: the float32 model now holds
        # exactly the values that end up in the checkpoint.
        model.to(dtype).to(torch.float32)
    return model


def make_z(model: AutoencoderKL, batch: int, h: int, w: int, gen: torch.Generator):
    """What FluxPipeline passes to vae.decode: latents / scaling + shift."""
    cfg = model.config
    latents = torch.randn(batch, cfg.latent_channels, h, w, generator=gen)
    return (latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)).contiguous()


@torch.no_grad()
def decode(model: AutoencoderKL, z: torch.Tensor) -> torch.Tensor:
    return model.decode(z, return_dict=False)[0].contiguous()


def postprocess_pil(image: torch.Tensor) -> Image.Image:
    """The exact call FluxPipeline makes (its processor's other settings do not
    touch output_type="pil")."""
    return VaeImageProcessor(vae_scale_factor=16).postprocess(image, output_type="pil")[0]


def write_case(case: dict, case_dir: Path) -> dict:
    for name in ("vae", "io.safetensors", "expected.png"):
        path = case_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    case_dir.mkdir(parents=True, exist_ok=True)

    model = build_model(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    z0 = make_z(model, 1, *case["res0"], gen)
    z1 = make_z(model, 2, *case["res1"], gen)
    image0, image1 = decode(model, z0), decode(model, z1)
    for t in (image0, image1):
        if not torch.isfinite(t).all():
            raise RuntimeError(f"{case['name']}: non-finite output")

    dtype = DTYPES[case["weights_dtype"]]
    to_save = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    to_save.save_pretrained(case_dir / "vae", safe_serialization=True)
    save_file({"z0": z0, "image0": image0, "z1": z1, "image1": image1},
              str(case_dir / "io.safetensors"))
    if case["png"]:
        postprocess_pil(image0).save(case_dir / "expected.png")

    # Self-check: the checkpoint reloads to the same parameters and output.
    reloaded = AutoencoderKL.from_pretrained(case_dir / "vae", torch_dtype=torch.float32).eval()
    ref_sd, new_sd = model.state_dict(), reloaded.state_dict()
    if ref_sd.keys() != new_sd.keys() or not all(torch.equal(ref_sd[k], new_sd[k]) for k in ref_sd):
        raise RuntimeError(f"{case['name']}: reloaded parameters differ from the saved ones")
    err = float((decode(reloaded, z0) - image0).abs().max())
    if err > 1e-5 * float(image0.abs().max()):
        raise RuntimeError(f"{case['name']}: reloaded checkpoint gives output off by {err}")

    cfg = {k: (list(v) if isinstance(v, tuple) else v)
           for k, v in model.config.items() if not k.startswith("_")}
    return {
        "name": case["name"],
        "seed": case["seed"],
        "config": cfg,
        "weights_dtype": case["weights_dtype"],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_decoder_parameters": sum(p.numel() for n, p in model.named_parameters()
                                      if n.startswith(("decoder.", "post_quant_conv."))),
        "z_shapes": [list(z0.shape), list(z1.shape)],
        "image_shapes": [list(image0.shape), list(image1.shape)],
        "image_range": [float(min(image0.min(), image1.min())),
                        float(max(image0.max(), image1.max()))],
        "expected_png": case["png"],
    }


def _f32_neighbours(v, n: int) -> list:
    """v and its n nearest float32 neighbours on either side."""
    out, up, down = [np.float32(v)], np.float32(v), np.float32(v)
    for _ in range(n):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    return out


def crafted_postprocess_input(seed: int, shape=(1, 3, 24, 32)) -> tuple[torch.Tensor, int]:
    """VAE outputs that exercise every branch of the postprocess quantisation."""
    f32 = np.float32
    vals = []
    ties = 0
    for k in range(255):
        target = f32(k + 0.5)
        # A float32 v in [0, 1] with fl32(v * 255) == k + 0.5 exactly, and an x
        # with fl32(fl32(x * 0.5) + 0.5) == v: numpy must then round half to
        # even.  Not every k has one (then the tie cannot occur at all).
        found = None
        for v in _f32_neighbours(f32((k + 0.5) / 255.0), 4):
            if f32(v * f32(255.0)) != target:
                continue
            for x in _f32_neighbours(f32(f32(2.0) * v - f32(1.0)), 2):
                if f32(f32(x * f32(0.5)) + f32(0.5)) == v:
                    found = x
                    break
            if found is not None:
                break
        if found is not None:
            vals += _f32_neighbours(found, 1)
            ties += 1
    vals += [f32(v) for v in (-1.0, 1.0, 0.0, -0.0, -1.5, 1.5, -3.0, 7.0, 1e-30, -1e-30,
                                 np.inf, -np.inf, 0.9999999, -0.9999999)]
    vals += [np.nextafter(f32(1.0), f32(2.0)), np.nextafter(f32(-1.0), f32(-2.0))]
    n = int(np.prod(shape))
    if len(vals) > n:
        raise RuntimeError("crafted values do not fit the image")
    rng = np.random.default_rng(seed)
    rest = rng.uniform(-1.2, 1.2, n - len(vals)).astype(f32)
    arr = np.concatenate([np.array(vals, dtype=f32), rest])
    rng.shuffle(arr)
    return torch.from_numpy(arr.reshape(shape).copy()), ties


def write_postprocess(out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    x, ties = crafted_postprocess_input(4711)
    save_file({"x": x}, str(out_dir / "postprocess.safetensors"))
    postprocess_pil(x).save(out_dir / "postprocess.png")
    return {"shape": list(x.shape), "exact_ties": ties}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory (default: %(default)s)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()

    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"diffusers_version": diffusers.__version__, "torch_version": torch.__version__,
                "cases": []}
    for case in CASES:
        info = write_case(case, args.out / case["name"])
        manifest["cases"].append(info)
        print(f"{case['name']}: {info['num_parameters']} parameters "
              f"({info['num_decoder_parameters']} decoder), images {info['image_shapes']}, "
              f"range {info['image_range'][0]:.3f} .. {info['image_range'][1]:.3f}")
    manifest["postprocess"] = write_postprocess(args.out / "postprocess")
    print(f"postprocess: {manifest['postprocess']}")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
