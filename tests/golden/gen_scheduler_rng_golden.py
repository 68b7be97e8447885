#!/usr/bin/env python3
"""Reference values for the scheduler and the noise generator.

Writes tests/data/scheduler/cases.json: for several FlowMatchEulerDiscreteScheduler
configs, step counts and image sequence lengths, the sigmas and timesteps that
diffusers' FluxPipeline computes (np.linspace sigmas, calculate_shift mu,
retrieve_timesteps), as exact float32 values (hex bit patterns).

Writes tests/data/scheduler/randn.safetensors: torch.randn(n) from
torch.Generator("cpu").manual_seed(seed) for several seeds and sizes, one tensor
"seed<seed>_n<n>" each, and the packed initial latents FluxPipeline.prepare_latents
makes for one seed and shape.

Run: python3 tests/golden/gen_scheduler_rng_golden.py   (needs torch, diffusers)
"""
import json
import pathlib
import struct

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "scheduler"

CONFIGS = {
    "flux_dynamic": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                         base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                         max_image_seq_len=4096),
    "static_shift3": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    "linear_shift": dict(num_train_timesteps=1000, use_dynamic_shifting=True,
                         time_shift_type="linear", base_shift=0.5, max_shift=1.15),
    "terminal": dict(num_train_timesteps=1000, use_dynamic_shifting=True, shift_terminal=0.1),
    "inverted": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False,
                     invert_sigmas=True),
}


def bits(values):
    return [struct.unpack("<I", struct.pack("<f", float(v)))[0] for v in values]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, cfg in CONFIGS.items():
        for steps in (1, 2, 4, 28, 50):
            for seq in (16, 256, 1024, 4096, 4608):
                s = FlowMatchEulerDiscreteScheduler(**cfg)
                sigmas = np.linspace(1.0, 1 / steps, steps)
                mu = calculate_shift(seq, s.config.get("base_image_seq_len", 256),
                                     s.config.get("max_image_seq_len", 4096),
                                     s.config.get("base_shift", 0.5),
                                     s.config.get("max_shift", 1.15))
                kwargs = dict(sigmas=sigmas)
                if s.config.use_dynamic_shifting:
                    kwargs["mu"] = mu
                timesteps, _ = retrieve_timesteps(s, steps, "cpu", **kwargs)
                if not torch.isfinite(s.sigmas).all():
                    continue  # shift_terminal with one step divides by zero in diffusers too
                cases.append(dict(config=name, steps=steps, image_seq_len=seq,
                                  sigmas=bits(s.sigmas.numpy()),
                                  timesteps=bits(timesteps.numpy())))
    (OUT / "cases.json").write_text(json.dumps(dict(configs=CONFIGS, cases=cases)))
    for name, cfg in CONFIGS.items():
        d = OUT / name
        d.mkdir(exist_ok=True)
        FlowMatchEulerDiscreteScheduler(**cfg).save_config(d)

    tensors = {}
    for seed in (0, 1, 42, 1234567, 2**32 + 5, 2**63 - 1):
        for n in (16, 17, 100, 1024, 4099):
            g = torch.Generator("cpu").manual_seed(seed)
            tensors[f"seed{seed}_n{n}"] = torch.randn(n, generator=g)
    # FluxPipeline.prepare_latents: randn (1, 16, 64, 48) then 2x2 packing.
    g = torch.Generator("cpu").manual_seed(7)
    lat = torch.randn((1, 16, 64, 48), generator=g, dtype=torch.float32)
    tensors["packed_seed7_16x64x48"] = FluxPipeline._pack_latents(lat, 1, 16, 64, 48).contiguous()
    save_file(tensors, str(OUT / "randn.safetensors"))
    print(f"{len(cases)} scheduler cases, {len(tensors)} noise tensors written to {OUT}")


if __name__ == "__main__":
    main()
