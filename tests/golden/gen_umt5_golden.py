#!/usr/bin/env python3
"""Generate reference data for ditserve's UMT5 text encoder as WanPipeline
uses it (diffusers' WanPipeline._get_t5_prompt_embeds and prompt_clean).

Run from anywhere (paths default to this repository's tests/data):

    python3 tests/golden/gen_umt5_golden.py [--out tests/data/umt5]

Needs torch, transformers, diffusers and safetensors (CPU; seconds).

What it writes under <out>/:

  text_encoder/config.json, model.safetensors
      a tiny random transformers UMT5EncoderModel (gated-gelu like Wan's
      umt5-xxl, every layer with its own relative_attention_bias), f32.
  io.safetensors
      float32 tensors, for every prompt k of PROMPTS:
        p<k>.ids               (L,) token ids (exact in f32), padded to L
        p<k>.hidden            (L, d_model) UMT5EncoderModel(ids, mask)
                               .last_hidden_state, padding rows included
        p<k>.embeds            (L, d_model) what _get_t5_prompt_embeds
                               returns: rows past the prompt's tokens zeroed
      and batch.embeds (len(PROMPTS), L, d_model), the whole list in one
      call of _get_t5_prompt_embeds (batch of different lengths).
  cases.json
      max_sequence_length L, the tokenizer folder (relative to tests/data),
      for every prompt its text, prompt_clean(text) and token count, and
      CLEAN_CASES: inputs with prompt_clean's output (html.unescape twice,
      whitespace runs to one space, strip; ftfy is treated as absent).

The tokenizer is the T5 unigram fixture tests/data/tokenizers/t5 (1100
pieces; AutoTokenizer gives T5TokenizerFast, as for Wan's umt5-xxl
tokenizer), so the model's vocab_size is 1100.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel
from transformers.models.umt5.modeling_umt5 import UMT5Attention, UMT5LayerNorm

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "umt5"
TOKENIZER_DIR = REPO_ROOT / "tests" / "data" / "tokenizers" / "t5"
L = 16

CONFIG = dict(vocab_size=1100, d_model=32, d_kv=8, num_heads=4, num_layers=3, d_ff=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
              relative_attention_max_distance=12, layer_norm_epsilon=1e-6,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

PROMPTS = [
    "",
    "a cat",
    "A red fox jumps over the lazy dog while the sun sets behind the hills of the valley",
    "  Tom &amp;amp; Jerry&nbsp;&lt;3\t\n  &#x41;  ",
    "a small boat on a lake",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
]

CLEAN_CASES = [
    "",
    "   ",
    "plain text",
    " \t\n a  b\r\nc\x0b\x0cd \u3000e\u00a0f\u2028g  ",
    "&amp;lt;b&amp;gt;",
    "&amp;amp;amp;",
    "&lt;&gt;&quot;&#39;&apos;&nbsp;",
    "&amp &lt &gt &copy &nbsp x",
    "&ampere &notin; &notit; &not &hellip;&mdash;&rarr;",
    "&#65;&#x42;&#X43;&#0067 &#x44",
    "&#0; &#13; &#128; &#150; &#x9f; &#xD800; &#1114112; &#99999999999999999999;",
    "&#1; &#x0B; &#xFFFE; &#x10FFFF; &#xFDD0;",
    "&unknown; & ; &; &# &#x; &#xg; a&b",
    "&NotNestedGreaterGreater; &acE; &fjlig; &bne;",
    "&aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa; &AMP; &Amp;",
    "caf\u00e9 \u00fcber \u65e5\u672c &eacute;&Eacute;&szlig;",
    "&\u00e9; &amp\u00e9",
    "x&lt\ty &amp\nz",
]


def basic_clean(text):
    text = html.unescape(html.unescape(text))
    return text.strip()


def whitespace_clean(text):
    text = re.sub(r"\s+", " ", text)
    return text.strip()


def prompt_clean(text):
    """diffusers.pipelines.wan.pipeline_wan.prompt_clean without ftfy."""
    return whitespace_clean(basic_clean(text))


@torch.no_grad()
def randomize(model: nn.Module, gen: torch.Generator) -> None:
    touched = set()

    def put(p, t):
        p.copy_(t)
        touched.add(id(p))

    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            put(mod.weight, torch.randn(mod.weight.shape, generator=gen) / math.sqrt(mod.in_features))
        elif isinstance(mod, UMT5LayerNorm):
            put(mod.weight, 1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
        elif isinstance(mod, nn.Embedding):
            put(mod.weight, torch.randn(mod.weight.shape, generator=gen))
    for name, p in model.named_parameters():
        if id(p) not in touched:
            raise RuntimeError(f"parameter {name} was not re-randomised")
    # UMT5 does not scale q.k by 1/sqrt(d_kv) (see gen_text_encoder_golden.py).
    for mod in model.modules():
        if isinstance(mod, UMT5Attention):
            mod.q.weight.mul_(mod.key_value_proj_dim ** -0.5)


@torch.no_grad()
def t5_prompt_embeds(tokenizer, text_encoder, prompt, max_sequence_length):
    """WanPipeline._get_t5_prompt_embeds, num_videos_per_prompt = 1."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    prompt = [prompt_clean(u) for u in prompt]
    text_inputs = tokenizer(prompt, padding="max_length", max_length=max_sequence_length,
                            truncation=True, add_special_tokens=True,
                            return_attention_mask=True, return_tensors="pt")
    ids, mask = text_inputs.input_ids, text_inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    hidden = text_encoder(ids, mask).last_hidden_state
    embeds = [u[:v] for u, v in zip(hidden, seq_lens)]
    embeds = torch.stack(
        [torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))]) for u in embeds],
        dim=0)
    return ids, seq_lens, hidden, embeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # The tables of the C port: Python's own prompt_clean must agree with
    # diffusers' (which would also run ftfy when installed).
    try:
        from diffusers.pipelines.wan import pipeline_wan
        if not pipeline_wan.is_ftfy_available():
            for c in CLEAN_CASES + PROMPTS:
                assert pipeline_wan.prompt_clean(c) == prompt_clean(c), c
    except ImportError:
        pass

    torch.manual_seed(55)
    gen = torch.Generator().manual_seed(55)
    model = UMT5EncoderModel(UMT5Config(**CONFIG)).eval()
    randomize(model, gen)
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.save_pretrained(str(out / "text_encoder"), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))

    io = {}
    prompts = []
    for k, p in enumerate(PROMPTS):
        ids, lens, hidden, embeds = t5_prompt_embeds(tokenizer, model, p, L)
        io[f"p{k}.ids"] = ids[0].to(torch.float32)
        io[f"p{k}.hidden"] = hidden[0].float().contiguous()
        io[f"p{k}.embeds"] = embeds[0].float().contiguous()
        prompts.append(dict(text=p, clean=prompt_clean(p), n_tokens=int(lens[0])))
    _, _, _, embeds = t5_prompt_embeds(tokenizer, model, PROMPTS, L)
    io["batch.embeds"] = embeds.float().contiguous()
    save_file(io, str(out / "io.safetensors"))
    cases = dict(max_sequence_length=L, tokenizer="tokenizers/t5", prompts=prompts,
                 clean=[dict(text=c, clean=prompt_clean(c)) for c in CLEAN_CASES])
    (out / "cases.json").write_text(json.dumps(cases, indent=1, ensure_ascii=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(PROMPTS)} prompts, {len(CLEAN_CASES)} clean cases to {out} "
          f"({total / 1024:.0f} KiB)")
    for p in prompts:
        print(p)


if __name__ == "__main__":
    main()
