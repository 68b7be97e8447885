#!/usr/bin/env python3
"""The bundled demo FluxPipeline and whole-pipeline reference cases.

Builds a tiny FluxPipeline from random weights in diffusers' folder layout:
transformer (FluxTransformer2DModel), vae (AutoencoderKL), text_encoder
(CLIPTextModel), text_encoder_2 (T5EncoderModel), tokenizer / tokenizer_2 (the
small trained tokenizers under tests/data/tokenizers/), scheduler
(FlowMatchEulerDiscreteScheduler with FLUX.1's dynamic shifting), and saves it
with save_pretrained to tests/data/demo/. It is the README's default model.

Then runs diffusers' FluxPipeline on it for several requests and writes, per
case, tests/data/pipeline_golden/<case>/:
  params.json            the request (prompt, sizes, steps, scales, seed, ...)
  reference.safetensors  initial_latents (packed, from the seed exactly as
                         prepare_latents draws them), final_latents (packed,
                         output_type="latent"), image (3, H, W) f32 as
                         vae.decode returns it
  expected.png           the image as pipe(...).images[0] (PIL) saves it
A second pipeline without guidance embeddings is saved next to the cases
(tests/data/pipeline_golden/noguidance_pipeline/).

With --num-images N (2 or 4; N alone defaults to 2) it only loads the saved
demo pipeline (weights unchanged) and writes num_images_per_prompt = N
references to tests/data/pipeline_golden_n<N>/<case>/ (reference.safetensors
with initial_latents (N, tokens, dim), final_latents (N, tokens, dim), image
(N, 3, H, W); params.json with "num_images": N). n = 2 covers square_2steps
and true_cfg; n = 4 only square_2steps, which keeps the fixture small.

Run: python3 tests/golden/gen_demo_pipeline.py [--num-images [N]]
     (torch, diffusers, transformers)
"""
import json
import math
import pathlib
import shutil
import sys

import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel)
from safetensors.torch import save_file
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config,
                          T5EncoderModel, T5TokenizerFast)

ROOT = pathlib.Path(__file__).resolve().parents[1] / "data"
TOKENIZERS = ROOT / "tokenizers"
DEMO = ROOT / "demo"
GOLDEN = ROOT / "pipeline_golden"


@torch.no_grad()
def randomize(model, gen, *, linear_gain=1.0, bias_std=0.05, norm_std=0.1, scale=None):
    """Re-draws every parameter so that no default init hides a bug."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            fan_in = p[0].numel()
            std = linear_gain / math.sqrt(fan_in)
            if scale and any(k in name for k in scale):
                std *= scale[next(k for k in scale if k in name)]
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * norm_std)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * bias_std)


def build_pipeline(seed, guidance_embeds=True, num_layers=2, num_single_layers=2):
    gen = torch.Generator().manual_seed(seed)
    tok = CLIPTokenizer.from_pretrained(TOKENIZERS / "clip")
    tok2 = T5TokenizerFast.from_pretrained(TOKENIZERS / "t5")
    eos = tok.eos_token_id
    # FLUX's CLIP-L config says eos_token_id 2 and relies on EOS being the
    # largest id (argmax pooling); keep that rule when it holds here.
    clip_eos = 2 if eos == max(tok.get_vocab().values()) else eos
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
        projection_dim=32, bos_token_id=tok.bos_token_id, eos_token_id=clip_eos,
        pad_token_id=tok.pad_token_id)).eval()
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id)).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6)).eval()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False).eval()
    randomize(clip, gen)
    randomize(t5, gen, scale={"SelfAttention.q": 1 / math.sqrt(8)})
    randomize(transformer, gen, scale={"norm": 0.5, "norm_out": 0.5})
    randomize(vae, gen)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tok,
                        text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer)


CASES = [
    dict(name="square_2steps", pipeline="demo", prompt="a red fox in the snow", width=64,
         height=64, steps=2, guidance_scale=3.5, seed=1),
    dict(name="wide_4steps", pipeline="demo", prompt="an old lighthouse at dusk, oil painting",
         width=128, height=96, steps=4, guidance_scale=5.0, seed=42),
    dict(name="true_cfg", pipeline="demo", prompt="a bowl of ramen", negative_prompt="blurry",
         true_cfg_scale=3.0, width=64, height=96, steps=3, guidance_scale=3.5, seed=7),
    dict(name="long_prompt_truncated", pipeline="demo",
         prompt=" ".join(["a very long prompt about mountains and rivers"] * 20),
         max_sequence_length=32, width=64, height=64, steps=2, guidance_scale=2.0, seed=3),
    dict(name="no_guidance_embeds", pipeline="noguidance", prompt="a cat sitting on a mat",
         width=96, height=64, steps=2, guidance_scale=0.0, seed=11),
]


def run_case(pipe, case, out):
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(prompt=case["prompt"], width=case["width"], height=case["height"],
              num_inference_steps=case["steps"], guidance_scale=case["guidance_scale"],
              max_sequence_length=case.get("max_sequence_length", 512))
    if "negative_prompt" in case:
        kw.update(negative_prompt=case["negative_prompt"], true_cfg_scale=case["true_cfg_scale"])
    # The initial latents exactly as prepare_latents draws them from the seed.
    g = torch.Generator("cpu").manual_seed(case["seed"])
    c = pipe.transformer.config.in_channels // 4
    h = 2 * (case["height"] // (pipe.vae_scale_factor * 2))
    w = 2 * (case["width"] // (pipe.vae_scale_factor * 2))
    noise = torch.randn((1, c, h, w), generator=g, dtype=torch.float32)
    init = FluxPipeline._pack_latents(noise, 1, c, h, w)
    with torch.no_grad():
        final = pipe(**kw, generator=torch.Generator("cpu").manual_seed(case["seed"]),
                     output_type="latent").images
        lat = FluxPipeline._unpack_latents(final, case["height"], case["width"],
                                           pipe.vae_scale_factor)
        lat = lat / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(lat, return_dict=False)[0]
        pil = pipe.image_processor.postprocess(image, output_type="pil")[0]
        # The seed path and the latents path must agree.
        again = pipe(**kw, latents=init.clone(), output_type="latent").images
        assert torch.equal(again, final), "latents= and generator= runs differ"
    save_file({"initial_latents": init.contiguous(), "final_latents": final.contiguous(),
               "image": image[0].contiguous()}, str(out / "reference.safetensors"))
    pil.save(out / "expected.png")
    params = {k: v for k, v in case.items() if k not in ("name", "pipeline")}
    (out / "params.json").write_text(json.dumps(params, indent=1))
    return float(final.abs().max()), float(image.abs().max())


N_CASES = {2: ("square_2steps", "true_cfg"), 4: ("square_2steps",)}


def run_case_n2(pipe, case, out, n=2):
    """num_images_per_prompt = n: one randn((n, C, h, w)) from the seed."""
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(prompt=case["prompt"], width=case["width"], height=case["height"],
              num_inference_steps=case["steps"], guidance_scale=case["guidance_scale"],
              max_sequence_length=case.get("max_sequence_length", 512),
              num_images_per_prompt=n)
    if "negative_prompt" in case:
        kw.update(negative_prompt=case["negative_prompt"], true_cfg_scale=case["true_cfg_scale"])
    g = torch.Generator("cpu").manual_seed(case["seed"])
    c = pipe.transformer.config.in_channels // 4
    h = 2 * (case["height"] // (pipe.vae_scale_factor * 2))
    w = 2 * (case["width"] // (pipe.vae_scale_factor * 2))
    noise = torch.randn((n, c, h, w), generator=g, dtype=torch.float32)
    init = FluxPipeline._pack_latents(noise, n, c, h, w)
    with torch.no_grad():
        final = pipe(**kw, generator=torch.Generator("cpu").manual_seed(case["seed"]),
                     output_type="latent").images
        lat = FluxPipeline._unpack_latents(final, case["height"], case["width"],
                                           pipe.vae_scale_factor)
        lat = lat / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(lat, return_dict=False)[0]
        again = pipe(**kw, latents=init.clone(), output_type="latent").images
        assert torch.equal(again, final), "latents= and generator= runs differ"
    assert final.shape[0] == n and image.shape[0] == n
    save_file({"initial_latents": init.contiguous(), "final_latents": final.contiguous(),
               "image": image.contiguous()}, str(out / "reference.safetensors"))
    params = {k: v for k, v in case.items() if k not in ("name", "pipeline")}
    params["num_images"] = n
    (out / "params.json").write_text(json.dumps(params, indent=1))
    return float(final.abs().max()), float(image.abs().max())


def main_num_images(n):
    if n not in N_CASES:
        sys.exit(f"--num-images wants one of {sorted(N_CASES)}, not {n}")
    torch.set_num_threads(1)
    pipe = FluxPipeline.from_pretrained(DEMO)
    for case in (c for c in CASES if c["name"] in N_CASES[n]):
        mx_lat, mx_img = run_case_n2(pipe, case, ROOT / f"pipeline_golden_n{n}" / case["name"], n)
        print(f"{case['name']:24s} n={n} max|latents| {mx_lat:.3f} max|image| {mx_img:.3f}")


def main():
    args = sys.argv[1:]
    if "--num-images" in args:
        rest = args[args.index("--num-images") + 1:]
        return main_num_images(int(rest[0]) if rest else 2)
    torch.set_num_threads(1)  # deterministic reductions
    demo = build_pipeline(seed=4242)
    if DEMO.exists():
        shutil.rmtree(DEMO)
    demo.save_pretrained(DEMO, safe_serialization=True)
    nog = build_pipeline(seed=777, guidance_embeds=False, num_layers=1, num_single_layers=1)
    nog_dir = GOLDEN / "noguidance_pipeline"
    if nog_dir.exists():
        shutil.rmtree(nog_dir)
    nog.save_pretrained(nog_dir, safe_serialization=True)
    pipes = {"demo": FluxPipeline.from_pretrained(DEMO), "noguidance": FluxPipeline.from_pretrained(nog_dir)}
    for case in CASES:
        mx_lat, mx_img = run_case(pipes[case["pipeline"]], case, GOLDEN / case["name"])
        print(f"{case['name']:24s} max|latents| {mx_lat:.3f} max|image| {mx_img:.3f}")


if __name__ == "__main__":
    main()
