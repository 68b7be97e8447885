#!/usr/bin/env python3
"""Generate reference data for ditserve's text encoders (FluxPipeline's
`text_encoder`, a transformers CLIPTextModel, and `text_encoder_2`, a
transformers T5EncoderModel).

Run from anywhere (paths default to this repository's tests/data):

    python3 tests/golden/gen_text_encoder_golden.py [--out tests/data/text_encoders]

Needs torch, transformers and safetensors (CPU; a run takes seconds).

What it writes
--------------
For every case in CASES, under <out>/<case_name>/:

  config.json, model.safetensors   transformers `save_pretrained` output.
                                   Weights are float32 except where a case
                                   says bfloat16; the reference forward then
                                   runs in float32 on the rounded weights.
                                   For `clip_legacy_eos` every tensor name is
                                   prefixed with "text_model." the way
                                   transformers 4.x (and FLUX.1's
                                   text_encoder/ checkpoint) names them;
                                   transformers 5 writes them unprefixed
                                   (`clip_first_eos`).
  io.safetensors                   float32 tensors, for run k = 0, 1, ...:
                                     run<k>.ids                (B, S) token ids
                                                               (exact in f32)
                                     run<k>.last_hidden_state  (B, S, hidden)
                                     run<k>.pooler_output      (B, hidden), CLIP only
                                   and, for T5 cases, bucket tables
                                     buckets_<num_buckets>_<max_distance>
                                       (2 * BUCKET_SPAN + 1,): bucket of the
                                       relative position (index - BUCKET_SPAN),
                                       from T5Attention._relative_position_bucket
                                       (bidirectional), to check the C port of
                                       its float32 log arithmetic.

All outputs are transformers' float32 forward with the default attention
implementation, no attention mask (as FluxPipeline calls both encoders), torch
single-threaded and seeded, so re-running reproduces the files.

Weights are not transformers' init: every parameter is re-drawn (see
`randomize`) so that LayerNorm/RMSNorm weights are around 1 but not 1, biases
are non-zero and the relative attention bias is large enough to matter, so
an ordering or transposition bug cannot hide.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
from transformers.models.t5.modeling_t5 import T5Attention, T5LayerNorm

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "text_encoders"

BUCKET_SPAN = 600
BUCKET_CONFIGS = [(32, 128), (16, 20), (64, 300), (10, 50), (31, 128)]

# CLIP cases. `runs` is a list of (batch, seq_len); ids are made by make_clip_ids.
CLIP_CASES = [
    # FLUX.1's CLIP-L in miniature: quick_gelu, eos_token_id == 2 (the legacy
    # pooling rule: argmax of the ids), EOS = the highest id, padding with EOS.
    dict(name="clip_legacy_eos", seed=11, prefix="text_model.", runs=[(1, 77), (2, 77), (2, 12)],
         config=dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
                     layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=1),
         bos=998, eos=999),
    # eos_token_id != 2: pooling takes the first occurrence of eos_token_id;
    # exact GELU, 2 heads of 16, a different LayerNorm eps, unprefixed names.
    dict(name="clip_first_eos", seed=22, prefix="", runs=[(1, 77), (2, 77), (3, 9)],
         config=dict(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu",
                     layer_norm_eps=1e-6, bos_token_id=3, eos_token_id=5, pad_token_id=4),
         bos=3, eos=5),
]

T5_CASES = [
    # T5 v1.1 / FLUX's T5-XXL in miniature: gated-gelu (gelu_new), 32 buckets,
    # max distance 128; the length-200 run reaches the clamped buckets.
    dict(name="t5_gated_gelu", seed=33, dtype=torch.float32, runs=[(1, 16), (2, 64), (1, 200)],
         config=dict(vocab_size=400, d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64,
                     feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                     relative_attention_max_distance=128, layer_norm_epsilon=1e-6)),
    # Original T5's non-gated relu FFN, inner dim (2 x 12) != d_model, 3 layers,
    # 16 buckets / max distance 20, bfloat16 weights.
    dict(name="t5_relu_bf16", seed=44, dtype=torch.bfloat16, runs=[(2, 16), (1, 64)],
         config=dict(vocab_size=300, d_model=32, d_kv=12, num_heads=2, num_layers=3, d_ff=48,
                     feed_forward_proj="relu", relative_attention_num_buckets=16,
                     relative_attention_max_distance=20, layer_norm_epsilon=1e-6)),
]


@torch.no_grad()
def randomize(model: nn.Module, gen: torch.Generator) -> None:
    """Re-draw every parameter; fail if one is not covered."""
    touched = set()

    def put(p, t):
        p.copy_(t)
        touched.add(id(p))

    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            put(mod.weight, torch.randn(mod.weight.shape, generator=gen) / math.sqrt(mod.in_features))
            if mod.bias is not None:
                put(mod.bias, torch.randn(mod.bias.shape, generator=gen) * 0.1)
        elif isinstance(mod, nn.LayerNorm):
            put(mod.weight, 1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
            put(mod.bias, 0.1 * torch.randn(mod.bias.shape, generator=gen))
        elif isinstance(mod, T5LayerNorm):
            put(mod.weight, 1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
        elif isinstance(mod, nn.Embedding):
            # The relative attention bias must be able to move the softmax.
            scale = 1.0 if mod.weight.shape[1] <= 64 and mod.weight.shape[0] <= 64 else 0.5
            put(mod.weight, scale * torch.randn(mod.weight.shape, generator=gen))
    for name, p in model.named_parameters():
        if id(p) not in touched:
            raise RuntimeError(f"parameter {name} was not re-randomised")
    # T5 does not scale q.k by 1/sqrt(d_kv): its initialisation folds that
    # factor into q. Without it the unscaled scores are large enough that f32
    # rounding in q and k (amplified by the score magnitude) costs most of the
    # 1e-5 tolerance at S = 200.
    for mod in model.modules():
        if isinstance(mod, T5Attention):
            mod.q.weight.mul_(mod.key_value_proj_dim ** -0.5)


def make_clip_ids(case, B, S, gen):
    """Token ids with BOS/EOS at varied places, so both pooling rules matter."""
    V, bos, eos = case["config"]["vocab_size"], case["bos"], case["eos"]
    ids = torch.randint(6, V - 2, (B, S), generator=gen)
    for b in range(B):
        ids[b, 0] = bos
        if b == 0:
            # A prompt of a few tokens, EOS, then EOS padding (FLUX's CLIP
            # tokenizer pads with the EOS token).
            n = min(S - 1, 5 + 7 * (S % 5))
            ids[b, n:] = eos
        elif b == 1:
            # EOS twice, early and late, real tokens in between: the legacy
            # rule picks the first maximum, the other the first EOS.
            ids[b, S // 3] = eos
            ids[b, S - 1] = eos
        else:
            # No EOS at all: legacy argmax lands on the largest ordinary id,
            # the first-occurrence rule falls back to position 0.
            pass
    return ids


def make_t5_ids(V, B, S, gen):
    """Random ids with EOS (1) and trailing padding (0), as T5's tokenizer
    pads FLUX prompts to max_sequence_length."""
    ids = torch.randint(2, V, (B, S), generator=gen)
    for b in range(B):
        n = max(1, S // (2 + b))
        ids[b, n - 1] = 1
        ids[b, n:] = 0
    return ids


def rename_with_prefix(path: Path, prefix: str) -> None:
    if not prefix:
        return
    tensors = load_file(str(path))
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


@torch.no_grad()
def gen_clip(case, out: Path) -> dict:
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    cfg = CLIPTextConfig(**case["config"])
    model = CLIPTextModel(cfg).eval()
    randomize(model, gen)
    d = out / case["name"]
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(str(d), safe_serialization=True)
    rename_with_prefix(d / "model.safetensors", case["prefix"])
    io = {}
    runs = []
    for k, (B, S) in enumerate(case["runs"]):
        ids = make_clip_ids(case, B, S, gen)
        o = model(input_ids=ids)
        io[f"run{k}.ids"] = ids.to(torch.float32)
        io[f"run{k}.last_hidden_state"] = o.last_hidden_state.float().contiguous()
        io[f"run{k}.pooler_output"] = o.pooler_output.float().contiguous()
        runs.append(dict(batch=B, seq=S, max_abs_hidden=float(o.last_hidden_state.abs().max())))
    save_file(io, str(d / "io.safetensors"))
    return dict(kind="clip", runs=runs, config=case["config"], prefix=case["prefix"])


@torch.no_grad()
def gen_t5(case, out: Path) -> dict:
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    cfg = T5Config(**case["config"])
    model = T5EncoderModel(cfg).eval()
    randomize(model, gen)
    model = model.to(case["dtype"])
    d = out / case["name"]
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(str(d), safe_serialization=True)
    # The reference runs in float32 on exactly the saved (rounded) values.
    model = model.to(torch.float32)
    io = {}
    runs = []
    for k, (B, S) in enumerate(case["runs"]):
        ids = make_t5_ids(case["config"]["vocab_size"], B, S, gen)
        o = model(input_ids=ids)
        io[f"run{k}.ids"] = ids.to(torch.float32)
        io[f"run{k}.last_hidden_state"] = o.last_hidden_state.float().contiguous()
        runs.append(dict(batch=B, seq=S, max_abs_hidden=float(o.last_hidden_state.abs().max())))
    rel = torch.arange(-BUCKET_SPAN, BUCKET_SPAN + 1)
    for nb, md in BUCKET_CONFIGS:
        bk = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=nb,
                                                   max_distance=md)
        io[f"buckets_{nb}_{md}"] = bk.to(torch.float32)
    save_file(io, str(d / "io.safetensors"))
    return dict(kind="t5", runs=runs, config=case["config"], dtype=str(case["dtype"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for case in CLIP_CASES:
        manifest[case["name"]] = gen_clip(case, args.out)
    for case in T5_CASES:
        manifest[case["name"]] = gen_t5(case, args.out)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {len(manifest)} cases to {args.out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
