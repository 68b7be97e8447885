#!/usr/bin/env python3
"""Generate LoRA adapters and diffusers' outputs with them, for ditserve's
LoRA tests.

    /work/pyenv/bin/python tests/golden/gen_lora_golden.py   (or any python
    with torch, diffusers 0.42, peft and safetensors; CPU, seconds)

Writes tests/data/lora/:

  Adapters for the FLUX golden case `parallel_even` (tests/data/golden):
    peft.safetensors         diffusers/PEFT keys "transformer.<module>.lora_A/B
                             .weight", rank 4, no alpha (scaling 1), on every
                             attention and feed-forward linear, the AdaLN
                             linears, the single blocks' proj_mlp/proj_out and
                             the embedders.
    kohya.safetensors        kohya keys "lora_unet_<name>.lora_down/up.weight"
                             with ".alpha" (scaling alpha / rank): fused qkv
                             (image: one `down` shared by q, k, v; text:
                             block-diagonal at rank 3 r), single-block
                             linear2 / modulation_lin, mlp, mod_lin,
                             attention projections, the embedders, and the
                             final layer (BFL's (shift, scale) order).
    subset.safetensors       PEFT keys on three modules only, with ".alpha"
                             (rank 2, alpha 3) and a bf16 dtype.
    bad_unknown_key.safetensors, bad_shape.safetensors, bad_rank.safetensors
                             refusals: a key no format has, an A with the
                             wrong input width, A and B of different ranks.
  expected.safetensors       diffusers' float32 forward on the case's inputs:
    peft                     peft.safetensors at weight 1
    kohya                    kohya.safetensors at weight 1 (through
                             FluxPipeline.lora_state_dict + load_lora_into_
                             transformer, i.e. load_lora_weights' path, with
                             the keys diffusers 0.42 converts unprefixed and
                             then drops put back: see add_adapter)
    two                      peft at 0.7 and kohya at -0.4 (set_adapters)
    subset                   subset.safetensors at weight 1.5
    kohya_linear1            kohya_linear1.safetensors (single blocks' fused
                             linear1 with alpha 3, rank 4), through its PEFT
                             equivalent split by this model's widths
    meta                     meta.safetensors (PEFT keys without prefix and
                             diffusers' lora_adapter_metadata: r 4,
                             lora_alpha 8) on to_q, ff.net.2 and proj_mlp
    wan                      wan_peft.safetensors at weight 0.9 on the Wan case
                             wan_golden/parallel_even
  wan_peft.safetensors       PEFT keys with ".alpha" (rank 3, alpha 6) on every
                             attention and feed-forward linear of Wan's
                             blocks, time_proj and proj_out.
  A pipeline adapter for tests/data/demo's transformer:
    demo_peft.safetensors    PEFT keys, rank 4
    demo_reference.safetensors  final_latents of FluxPipeline with it loaded
                             (load_lora_weights, weight 0.8), the request of
                             tests/data/pipeline_golden/square_2steps.

Everything is seeded; torch runs single-threaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from diffusers import FluxPipeline, FluxTransformer2DModel, WanTransformer3DModel

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
OUT = DATA / "lora"
CASE = DATA / "golden" / "parallel_even"
WAN_CASE = DATA / "wan_golden" / "parallel_even"


def lin(model, name):
    m = model.get_submodule(name)
    return m.out_features, m.in_features


def rand_pair(g, n, k, r, b_gain=0.3):
    a = torch.randn((r, k), generator=g) / k**0.5
    b = torch.randn((n, r), generator=g) * b_gain / r**0.5
    return a, b


def flux_modules(model):
    cfg = model.config
    mods = ["x_embedder", "context_embedder", "time_text_embed.timestep_embedder.linear_1",
            "norm_out.linear", "proj_out"]
    for i in range(cfg.num_layers):
        p = f"transformer_blocks.{i}."
        mods += [p + s for s in ("norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k",
                                 "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                                 "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out",
                                 "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                 "ff_context.net.2")]
    for i in range(cfg.num_single_layers):
        p = f"single_transformer_blocks.{i}."
        mods += [p + s for s in ("norm.linear", "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp",
                                 "proj_out")]
    return mods


def peft_adapter(model, mods, r, g, alpha=None, dtype=torch.float32):
    sd = {}
    for m in mods:
        n, k = lin(model, m)
        a, b = rand_pair(g, n, k, r)
        sd[f"transformer.{m}.lora_A.weight"] = a.to(dtype)
        sd[f"transformer.{m}.lora_B.weight"] = b.to(dtype)
        if alpha is not None:
            sd[f"transformer.{m}.alpha"] = torch.tensor(float(alpha))
    return sd


def kohya_adapter(model, g):
    cfg = model.config
    C = cfg.num_attention_heads * cfg.attention_head_dim
    sd = {}

    def put(name, n, k, r, alpha):
        a, b = rand_pair(g, n, k, r)
        sd[f"lora_unet_{name}.lora_down.weight"] = a
        sd[f"lora_unet_{name}.lora_up.weight"] = b
        if alpha is not None:
            sd[f"lora_unet_{name}.alpha"] = torch.tensor(float(alpha))

    for i in range(cfg.num_layers):
        put(f"double_blocks_{i}_img_attn_qkv", 3 * C, C, 4, 2.0)
        # Block-diagonal at rank 3 r (diffusers splits `down` in three).
        put(f"double_blocks_{i}_txt_attn_qkv", 3 * C, C, 6, None)
        up = sd[f"lora_unet_double_blocks_{i}_txt_attn_qkv.lora_up.weight"]
        for j in range(3):
            for k in range(3):
                if j != k:
                    up[j * C:(j + 1) * C, 2 * k:2 * k + 2] = 0
        put(f"double_blocks_{i}_img_attn_proj", C, C, 4, 8.0)
        put(f"double_blocks_{i}_txt_attn_proj", C, C, 2, 1.0)
        put(f"double_blocks_{i}_img_mlp_0", *lin(model, f"transformer_blocks.{i}.ff.net.0.proj"), 4, 4.0)
        put(f"double_blocks_{i}_txt_mlp_2", *lin(model, f"transformer_blocks.{i}.ff_context.net.2"), 4, 4.0)
        put(f"double_blocks_{i}_img_mod_lin", 6 * C, C, 2, 2.0)
    for i in range(cfg.num_single_layers):
        p = f"single_transformer_blocks.{i}."
        # linear1 (fused q, k, v, proj_mlp) is left out: diffusers splits it
        # by FLUX.1's own widths (3072, 3072, 3072, 12288) whatever the model.
        put(f"single_blocks_{i}_linear2", *lin(model, p + "proj_out"), 4, 4.0)
        put(f"single_blocks_{i}_modulation_lin", 3 * C, C, 4, None)
    put("img_in", *lin(model, "x_embedder"), 2, 2.0)
    put("txt_in", *lin(model, "context_embedder"), 2, 2.0)
    put("final_layer_linear", *lin(model, "proj_out"), 2, None)
    put("final_layer_adaLN_modulation_1", *lin(model, "norm_out.linear"), 2, None)
    return sd


def load_transformer():
    return FluxTransformer2DModel.from_pretrained(CASE / "transformer", torch_dtype=torch.float32)


def add_adapter(model, path, name):
    sd, alphas = FluxPipeline.lora_state_dict(str(path), return_alphas=True)
    # diffusers 0.42 converts kohya's img_in, txt_in and final_layer keys
    # without the "transformer." prefix, so load_lora_into_transformer drops
    # them; ditserve applies them, so the reference puts the prefix back and
    # keeps diffusers' own conversion of them (scaling, BFL's (shift, scale)
    # swap).
    sd = {k if k.startswith("transformer.") else "transformer." + k: v for k, v in sd.items()}
    FluxPipeline.load_lora_into_transformer(sd, network_alphas=alphas, transformer=model,
                                            adapter_name=name)


def forward(model, inputs):
    kw = {k: v for k, v in inputs.items()}
    with torch.no_grad():
        return model(**kw, return_dict=False)[0].contiguous()


def main():
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.Generator("cpu").manual_seed(7070)
    model = load_transformer()
    inputs = load_file(str(CASE / "inputs.safetensors"))
    base = forward(model, inputs)

    mods = flux_modules(model)
    save_file(peft_adapter(model, mods, 4, g), str(OUT / "peft.safetensors"))
    save_file(kohya_adapter(model, g), str(OUT / "kohya.safetensors"))
    subset = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2",
              "single_transformer_blocks.1.proj_out"]
    save_file(peft_adapter(model, subset, 2, g, alpha=3.0, dtype=torch.bfloat16),
              str(OUT / "subset.safetensors"))

    # kohya's single-block linear1 (q, k, v, proj_mlp fused), which diffusers
    # splits by FLUX.1's widths only: the reference splits `up` by this
    # model's widths and loads the PEFT equivalent.
    k1, k1_peft = {}, {}
    for i in range(model.config.num_single_layers):
        p = f"single_transformer_blocks.{i}."
        parts = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
        widths = [lin(model, p + m)[0] for m in parts]
        a, b = rand_pair(g, sum(widths), lin(model, p + "attn.to_q")[1], 4)
        k1[f"lora_unet_single_blocks_{i}_linear1.lora_down.weight"] = a
        k1[f"lora_unet_single_blocks_{i}_linear1.lora_up.weight"] = b
        k1[f"lora_unet_single_blocks_{i}_linear1.alpha"] = torch.tensor(3.0)
        for m, bm in zip(parts, torch.split(b, widths, dim=0)):
            k1_peft[f"transformer.{p}{m}.lora_A.weight"] = a.clone()
            k1_peft[f"transformer.{p}{m}.lora_B.weight"] = (bm * (3.0 / 4)).contiguous()
    save_file(k1, str(OUT / "kohya_linear1.safetensors"))

    # Refusals.
    bad = peft_adapter(model, ["transformer_blocks.0.attn.to_k"], 2, g)
    bad["transformer.transformer_blocks.0.attn.to_k.lora_magnitude_vector"] = torch.ones(4)
    save_file(bad, str(OUT / "bad_unknown_key.safetensors"))
    bad = peft_adapter(model, ["transformer_blocks.0.attn.to_k"], 2, g)
    bad["transformer.transformer_blocks.0.attn.to_k.lora_A.weight"] = torch.zeros(2, 7)
    save_file(bad, str(OUT / "bad_shape.safetensors"))
    bad = peft_adapter(model, ["transformer_blocks.1.ff.net.0.proj"], 2, g)
    bad["transformer.transformer_blocks.1.ff.net.0.proj.lora_B.weight"] = torch.zeros(
        lin(model, "transformer_blocks.1.ff.net.0.proj")[0], 3)
    save_file(bad, str(OUT / "bad_rank.safetensors"))

    expected = {}
    for name, adapters in (("peft", [("peft", 1.0)]), ("kohya", [("kohya", 1.0)]),
                           ("two", [("peft", 0.7), ("kohya", -0.4)]),
                           ("subset", [("subset", 1.5)])):
        m = load_transformer()
        for a, _ in adapters:
            add_adapter(m, OUT / f"{a}.safetensors", a)
        m.set_adapters([a for a, _ in adapters], [w for _, w in adapters])
        expected[name] = forward(m, inputs)
        rel = float((expected[name] - base).abs().max() / base.abs().max())
        print(f"{name:8s} max|sample| {float(expected[name].abs().max()):.3f}, "
              f"change from the base {rel:.3g} of max|base|")
    m = load_transformer()
    m.load_lora_adapter(k1_peft, prefix="transformer", adapter_name="k1")
    expected["kohya_linear1"] = forward(m, inputs)
    # Scale 0 is the base model exactly.
    m = load_transformer()
    add_adapter(m, OUT / "peft.safetensors", "peft")
    m.set_adapters(["peft"], [0.0])
    assert torch.equal(forward(m, inputs), base), "weight 0 differs from the base"
    save_file(expected, str(OUT / "expected.safetensors"))

    # Wan's transformer through the same generic path (PEFT keys, model-level
    # load_lora_adapter as WanLoraLoaderMixin does it).
    wan = WanTransformer3DModel.from_pretrained(WAN_CASE / "transformer", torch_dtype=torch.float32)
    wan_in = load_file(str(WAN_CASE / "inputs.safetensors"))
    wan_mods = []
    for i in range(wan.config.num_layers):
        p = f"blocks.{i}."
        wan_mods += [p + s for s in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                                     "ffn.net.0.proj", "ffn.net.2")]
    wan_mods += ["condition_embedder.time_proj", "proj_out"]
    wan_sd = peft_adapter(wan, wan_mods, 3, g, alpha=6.0)
    save_file(wan_sd, str(OUT / "wan_peft.safetensors"))

    def wan_forward(m):
        with torch.no_grad():
            return m(wan_in["hidden_states"], wan_in["timestep"].long(),
                     wan_in["encoder_hidden_states"], return_dict=False)[0].float().contiguous()

    wan_base = wan_forward(wan)
    alphas = {k: v for k, v in wan_sd.items() if k.endswith(".alpha")}
    wan.load_lora_adapter({k: v for k, v in wan_sd.items() if k not in alphas}, prefix="transformer",
                          network_alphas=alphas, adapter_name="w")
    wan.set_adapters(["w"], [0.9])
    expected["wan"] = wan_forward(wan)
    rel = float((expected["wan"] - wan_base).abs().max() / wan_base.abs().max())
    print(f"wan      max|sample| {float(expected['wan'].abs().max()):.3f}, change from the base "
          f"{rel:.3g} of max|base|")
    # A file with diffusers' "lora_adapter_metadata" (PEFT's LoraConfig, as
    # save_lora_adapter writes it): scaling lora_alpha / r = 8 / 4, no
    # .alpha keys, module names without the "transformer." prefix.
    torch.manual_seed(5151)
    m = load_transformer()
    m.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "ff.net.2", "proj_mlp"],
                             init_lora_weights=False), adapter_name="meta")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    m.save_lora_adapter(str(OUT / "meta_tmp"), adapter_name="meta")
    shutil.move(str(OUT / "meta_tmp" / "pytorch_lora_weights.safetensors"),
                str(OUT / "meta.safetensors"))
    shutil.rmtree(OUT / "meta_tmp")
    expected["meta"] = forward(m, inputs)
    save_file(expected, str(OUT / "expected.safetensors"))

    # The pipeline case.
    demo = DATA / "demo"
    pipe = FluxPipeline.from_pretrained(demo)
    save_file(peft_adapter(pipe.transformer, flux_modules(pipe.transformer), 4, g),
              str(OUT / "demo_peft.safetensors"))
    pipe.load_lora_weights(str(OUT / "demo_peft.safetensors"), adapter_name="demo")
    pipe.set_adapters(["demo"], [0.8])
    params = json.loads((DATA / "pipeline_golden" / "square_2steps" / "params.json").read_text())
    with torch.no_grad():
        final = pipe(prompt=params["prompt"], width=params["width"], height=params["height"],
                     num_inference_steps=params["steps"], guidance_scale=params["guidance_scale"],
                     generator=torch.Generator("cpu").manual_seed(params["seed"]),
                     output_type="latent").images
    save_file({"final_latents": final.contiguous()}, str(OUT / "demo_reference.safetensors"))
    print(f"pipeline max|latents| {float(final.abs().max()):.3f}")


if __name__ == "__main__":
    main()
