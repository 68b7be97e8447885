#!/usr/bin/env python3
"""Time diffusers' FluxTransformer2DModel forward on the CPU (the baseline for ditserve).

    python3 tests/bench/bench_diffusers_forward.py [--threads N] [--warmup 1] [--iters 5]
                                                   [--heads 8] [--head-dim 128] [--axes 16,56,56]
                                                   [--double 4] [--single 8]
                                                   [--img-tokens 1024] [--txt-tokens 128]
                                                   [--batch 1] [--joint-dim 4096]
                                                   [--pooled-dim 768] [--in-channels 64]
                                                   [--no-guidance] [--verify-flops]

The defaults are ditserve's benchmark config: 8 heads x 128 (hidden 1024),
4 double-stream + 8 single-stream blocks, 1024 image tokens (32x32 grid),
128 text tokens, guidance embedding on, batch 1.  Weights use diffusers'
default init (values do not matter for speed); everything runs in float32
under torch.no_grad().

Prints the environment, then one result line:

    diffusers forward: median X ms, min Y ms, Z GFLOP/s (T GFLOP), threads N, torch V

GFLOP/s is computed from the median time.  The FLOP count is analytic (see
`forward_flops`): 2*rows*in*out for every Linear applied, plus 4*B*S^2*inner_dim
for each attention (QK^T and PV), S = text + image tokens.  Elementwise work
(norms, RoPE, activations, softmax) is not counted.  --verify-flops checks the
Linear part against forward hooks on a real forward.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

import diffusers
from diffusers import FluxTransformer2DModel

TIMESTEP_PROJ_DIM = 256  # Flux's sinusoidal timestep/guidance embedding width


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads (default: os.cpu_count() = %(default)s)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8, help="num_attention_heads")
    ap.add_argument("--head-dim", type=int, default=128, help="attention_head_dim")
    ap.add_argument("--axes", default=None,
                    help="axes_dims_rope, comma separated; must sum to --head-dim "
                         "(default 16,56,56 for head dim 128, else an even split)")
    ap.add_argument("--double", type=int, default=4, help="num_layers (double-stream blocks)")
    ap.add_argument("--single", type=int, default=8, help="num_single_layers")
    ap.add_argument("--img-tokens", type=int, default=1024,
                    help="image tokens; laid out on the squarest h x w grid")
    ap.add_argument("--txt-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--joint-dim", type=int, default=4096, help="joint_attention_dim")
    ap.add_argument("--pooled-dim", type=int, default=768, help="pooled_projection_dim")
    ap.add_argument("--in-channels", type=int, default=64)
    ap.add_argument("--no-guidance", action="store_true", help="guidance_embeds=False")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-flops", action="store_true",
                    help="count Linear FLOPs with hooks during warmup and compare")
    return ap.parse_args(argv)


def default_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux's (16, 56, 56) for head dim 128; otherwise an even split into 3 even parts."""
    if head_dim == 128:
        return (16, 56, 56)
    if head_dim % 2:
        raise SystemExit("--head-dim must be even")
    pairs = head_dim // 2
    a = pairs // 3
    b = (pairs - a) // 2
    return (2 * a, 2 * b, 2 * (pairs - a - b))


def model_config(args) -> dict:
    axes = tuple(int(x) for x in args.axes.split(",")) if args.axes else default_axes(args.head_dim)
    if sum(axes) != args.head_dim or len(axes) != 3 or any(a % 2 for a in axes):
        raise SystemExit(f"axes {axes} must be 3 even numbers summing to {args.head_dim}")
    return dict(
        patch_size=1,
        in_channels=args.in_channels,
        num_layers=args.double,
        num_single_layers=args.single,
        attention_head_dim=args.head_dim,
        num_attention_heads=args.heads,
        joint_attention_dim=args.joint_dim,
        pooled_projection_dim=args.pooled_dim,
        guidance_embeds=not args.no_guidance,
        axes_dims_rope=axes,
    )


def grid_for(tokens: int) -> tuple[int, int]:
    """Squarest h x w with h * w == tokens (h <= w)."""
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return h, tokens // h


def linear_flops(cfg: dict, batch: int, txt: int, img: int) -> int:
    """2 * rows * in * out summed over every nn.Linear the forward applies."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    out_dim = cfg["patch_size"] ** 2 * (cfg.get("out_channels") or cfg["in_channels"])
    seq = txt + img

    def lin(rows, n_in, n_out):
        return 2 * rows * n_in * n_out

    f = 0
    # Embedders.  The timestep / guidance / pooled-text MLPs see one row per sample.
    f += lin(batch * img, cfg["in_channels"], d)                 # x_embedder
    f += lin(batch * txt, cfg["joint_attention_dim"], d)         # context_embedder
    n_time_mlps = 2 if cfg["guidance_embeds"] else 1
    f += n_time_mlps * (lin(batch, TIMESTEP_PROJ_DIM, d) + lin(batch, d, d))
    f += lin(batch, cfg["pooled_projection_dim"], d) + lin(batch, d, d)  # text_embedder

    # Double-stream block: each stream has AdaLN (D -> 6D, one row per sample),
    # q/k/v (3 x D -> D), the attention output projection (D -> D) and a GELU
    # MLP (D -> 4D -> D).
    per_stream = lambda rows: (lin(batch, d, 6 * d) + 3 * lin(rows, d, d) + lin(rows, d, d)
                               + lin(rows, d, 4 * d) + lin(rows, 4 * d, d))
    f += cfg["num_layers"] * (per_stream(batch * img) + per_stream(batch * txt))

    # Single-stream block on the concatenated sequence: AdaLN (D -> 3D),
    # q/k/v, proj_mlp (D -> 4D) and proj_out over [attn, mlp] (5D -> D).
    rows = batch * seq
    f += cfg["num_single_layers"] * (lin(batch, d, 3 * d) + 3 * lin(rows, d, d)
                                     + lin(rows, d, 4 * d) + lin(rows, 5 * d, d))

    # Output: AdaLayerNormContinuous (D -> 2D) and proj_out on image tokens.
    f += lin(batch, d, 2 * d) + lin(batch * img, d, out_dim)
    return f


def attention_flops(cfg: dict, batch: int, txt: int, img: int) -> int:
    """QK^T and PV of joint attention: 4 * B * S^2 * inner_dim per block."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    seq = txt + img
    return (cfg["num_layers"] + cfg["num_single_layers"]) * 4 * batch * seq * seq * d


def forward_flops(cfg, batch, txt, img) -> int:
    return linear_flops(cfg, batch, txt, img) + attention_flops(cfg, batch, txt, img)


def make_inputs(cfg: dict, batch: int, txt: int, img: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h, w = grid_for(img)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h, dtype=torch.float32)[:, None]
    img_ids[..., 2] = torch.arange(w, dtype=torch.float32)[None, :]
    inputs = dict(
        hidden_states=torch.randn(batch, img, cfg["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, txt, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_ids=img_ids.reshape(img, 3),
        txt_ids=torch.zeros(txt, 3),
    )
    if cfg["guidance_embeds"]:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs


def count_linear_flops(model: nn.Module, run) -> int:
    """Run `run()` once with hooks on every nn.Linear and sum 2*rows*in*out."""
    total = 0

    def hook(mod, inp, _out):
        nonlocal total
        rows = inp[0].numel() // mod.in_features
        total += 2 * rows * mod.in_features * mod.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return total


def gflop(flops: float) -> str:
    g = flops / 1e9
    return f"{g:.1f}" if g >= 10 else f"{g:.3g}"


def sdpa_backend(cfg: dict, batch: int, seq: int) -> str:
    """Which fused SDPA kernel torch picks for this (B, H, S, D) float32 CPU call."""
    try:
        from torch.nn.attention import SDPBackend
        q = torch.empty(batch, cfg["num_attention_heads"], seq, cfg["attention_head_dim"])
        return SDPBackend(torch._fused_sdp_choice(q, q, q)).name
    except Exception as exc:  # private API; informative only
        return f"unknown ({type(exc).__name__})"


def blas_summary() -> str:
    """BLAS / CPU ISA as reported by torch.__config__.show()."""
    parts = []
    for line in torch.__config__.show().splitlines():
        s = line.strip().lstrip("- ")
        if s.startswith(("Intel(R) oneAPI Math Kernel Library", "Intel(R) MKL-DNN",
                         "CPU capability usage")):
            s = s.replace(" for Intel(R) 64 architecture applications", "")
            parts.append(s.split(" (Git Hash")[0])
        elif s.startswith("Build settings:"):
            parts += [kv.strip() for kv in s.split(",") if kv.strip().startswith("BLAS_INFO=")]
    return "; ".join(parts) or "unknown"


def print_environment(args, cfg: dict) -> None:
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"python {sys.version.split()[0]}, threads {torch.get_num_threads()} "
          f"(os.cpu_count() {os.cpu_count()})")
    print(f"blas: {blas_summary()}; mkl={torch.backends.mkl.is_available()} "
          f"mkldnn={torch.backends.mkldnn.is_available()}")
    print(f"sdpa: {sdpa_backend(cfg, args.batch, args.txt_tokens + args.img_tokens)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    diffusers.utils.logging.set_verbosity_error()

    cfg = model_config(args)
    b, txt, img = args.batch, args.txt_tokens, args.img_tokens
    print_environment(args, cfg)
    print(f"config: {cfg}, batch {b}, txt {txt}, img {img} (grid {grid_for(img)})")

    torch.manual_seed(args.seed)
    model = FluxTransformer2DModel(**cfg).to(torch.float32).eval()
    inputs = make_inputs(cfg, b, txt, img, args.seed)

    flops = forward_flops(cfg, b, txt, img)
    print(f"flops: total {gflop(flops)} GFLOP = linear {gflop(linear_flops(cfg, b, txt, img))}"
          f" + attention {gflop(attention_flops(cfg, b, txt, img))}")

    def forward():
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    if args.verify_flops:
        counted = count_linear_flops(model, forward)
        expected = linear_flops(cfg, b, txt, img)
        status = "OK" if counted == expected else "MISMATCH"
        print(f"verify-flops: hooks {counted} vs analytic {expected}: {status}")
        if counted != expected:
            return 1

    for _ in range(args.warmup):
        forward()
    times_ms = []
    for i in range(args.iters):
        t0 = time.perf_counter()
        out = forward()
        times_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"iter {i}: {times_ms[-1]:.1f} ms")
    assert torch.isfinite(out).all()

    median = statistics.median(times_ms)
    print(f"diffusers forward: median {median:.1f} ms, min {min(times_ms):.1f} ms, "
          f"{flops / (median * 1e-3) / 1e9:.1f} GFLOP/s ({gflop(flops)} GFLOP), "
          f"threads {args.threads}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
