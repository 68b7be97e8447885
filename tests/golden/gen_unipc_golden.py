#!/usr/bin/env python3
"""Reference values for UniPCMultistepScheduler as WanPipeline drives it.

For several configs (Wan 2.1's scheduler_config.json at flow_shift 3.0 and 5.0,
and variations of solver order, solver type, corrector, final sigma) and step
counts, writes tests/data/scheduler/unipc/<config>/:

  scheduler_config.json   the config, as diffusers saves it
  expected.safetensors    for each step count N:
    sigmas_N     (N + 1,) f32, as set_timesteps stores them
    timesteps_N  (N,) the int64 timesteps the transformer gets, as f32
                 (exact: at most num_train_timesteps)
    samples_N    (N + 1, 60) f32, each row a (1, 4, 1, 3, 5) sample: the
                 initial sample, then the sample after each step()
    exactlog_N   the same run with the scheduler's scalar torch.log correctly
                 rounded (log in f64, rounded to f32), as the C code does it

tests/data/scheduler/unipc/schedules.safetensors: sigmas and timesteps only, for
Wan's config at flow_shift 1, 3, 5 and 7 and many step counts
("shift<s>_sigmas_<N>", "shift<s>_timesteps_<N>", s as an integer),
and tests/data/scheduler/unipc/inputs.safetensors: the initial sample `x0` and
`model_outputs` (50, 60) f32 (rows of shape (1, 4, 1, 3, 5)), seeded randn;
step i gets model_outputs[i] in f32, so diffusers computes the whole step in
f32. The step axis is flattened with the rest: the loader reads at most 5 dims.

torch's f32 log is vectorized (Sleef or MKL, chosen by the CPU's capability)
and not always correctly rounded; an ulp in lambda moves later samples by up
to ~2e-5 of their magnitude at order 3, so samples_N differ between machines
at that level. exactlog_N pins every other operation of the step.

Run: python3 tests/golden/gen_unipc_golden.py   (needs torch, diffusers)
"""
import pathlib

import numpy as np
import torch
import diffusers.schedulers.scheduling_unipc_multistep as unipc_module
from diffusers import UniPCMultistepScheduler
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "scheduler" / "unipc"
SHAPE = (1, 4, 1, 3, 5)
STEPS = (1, 2, 3, 5, 10, 50)
SCHEDULE_SHIFTS = (1.0, 3.0, 5.0, 7.0)
SCHEDULE_STEPS = tuple(range(1, 41)) + (50, 64, 100, 250, 1000)

# Wan 2.1's scheduler/scheduler_config.json (flow_shift 3.0: 480p).
WAN = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
           solver_order=2, prediction_type="flow_prediction", thresholding=False,
           predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
           use_flow_sigmas=True, flow_shift=3.0, timestep_spacing="linspace", steps_offset=0,
           final_sigmas_type="zero")

CONFIGS = {
    "wan_480p": dict(WAN),
    "wan_720p": dict(WAN, flow_shift=5.0),
    "order1": dict(WAN, solver_order=1),
    "order3": dict(WAN, solver_order=3, flow_shift=5.0),
    # bh1 with a final sigma of zero gives NaN on the last step in diffusers (B(h) = -inf).
    "bh1_sigma_min": dict(WAN, solver_type="bh1", final_sigmas_type="sigma_min"),
    "no_corrector_0_3": dict(WAN, disable_corrector=[0, 3]),
    "sigma_min": dict(WAN, final_sigmas_type="sigma_min", flow_shift=2.0),
}


class _ExactLogTorch:
    """torch, with log of 0-dim tensors computed in f64 and rounded to f32."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def log(t):
        if t.dim() != 0:
            return torch.log(t)
        with np.errstate(divide="ignore"):
            return torch.tensor(np.float32(np.log(np.float64(t.item()))))


def run(cfg, n, x0, mo):
    s = UniPCMultistepScheduler(**cfg)
    s.set_timesteps(n, device="cpu")
    x = x0.clone()
    samples = [x]
    for i, t in enumerate(s.timesteps):
        x = s.step(mo[i], t, x, return_dict=False)[0]
        assert x.dtype == torch.float32
        samples.append(x)
    return s, torch.stack(samples).reshape(n + 1, -1).contiguous()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.Generator("cpu").manual_seed(1234)
    x0 = torch.randn(SHAPE, generator=g, dtype=torch.float32)
    mo = torch.randn((max(STEPS),) + SHAPE, generator=g, dtype=torch.float32)
    save_file({"x0": x0, "model_outputs": mo.reshape(len(mo), -1).contiguous()},
              str(OUT / "inputs.safetensors"))
    for name, cfg in CONFIGS.items():
        d = OUT / name
        d.mkdir(exist_ok=True)
        UniPCMultistepScheduler(**cfg).save_config(d)
        tensors = {}
        for n in STEPS:
            s, samples = run(cfg, n, x0, mo)
            assert s.sigmas.dtype == torch.float32 and s.timesteps.dtype == torch.int64
            tensors[f"sigmas_{n}"] = s.sigmas.clone()
            # int64 values of at most num_train_timesteps, stored as exact f32
            assert (s.timesteps.float().long() == s.timesteps).all()
            tensors[f"timesteps_{n}"] = s.timesteps.float()
            tensors[f"samples_{n}"] = samples
            unipc_module.torch = _ExactLogTorch()
            try:
                tensors[f"exactlog_{n}"] = run(cfg, n, x0, mo)[1]
            finally:
                unipc_module.torch = torch
            x = samples[-1]
            finite = bool(torch.isfinite(tensors[f"samples_{n}"]).all())
            print(f"{name} N={n}: finite={finite} last={x.flatten()[:3].tolist()}")
        save_file(tensors, str(d / "expected.safetensors"))
    tensors = {}
    for shift in SCHEDULE_SHIFTS:
        for n in SCHEDULE_STEPS:
            s = UniPCMultistepScheduler(**dict(WAN, flow_shift=shift))
            s.set_timesteps(n, device="cpu")
            assert (s.timesteps.float().long() == s.timesteps).all()
            tensors[f"shift{int(shift)}_sigmas_{n}"] = s.sigmas.clone()
            tensors[f"shift{int(shift)}_timesteps_{n}"] = s.timesteps.float()
    save_file(tensors, str(OUT / "schedules.safetensors"))


if __name__ == "__main__":
    main()
