#!/usr/bin/env python3
"""Reference values for the FP8 E4M3 dtype (torch.float8_e4m3fn).

Writes tests/data/fp8/e4m3_torch.safetensors with torch's own conversions,
saved by the safetensors library (so the file is also an F8_E4M3 file as
other tools write them):
  patterns  F8_E4M3 (256)  every bit pattern 0x00..0xff
  to_f32    F32 (256)      patterns.to(torch.float32)
  inputs    F32 (N)        edge cases (every tie between neighbours and one
                           ulp either side, 448, 464 and past it, 480,
                           infinities, NaN, f32 subnormals) and random
                           values with exponents 2^-14 .. 2^9
  from_f32  F8_E4M3 (N)    inputs.to(torch.float8_e4m3fn)

It checks that torch on CUDA, where present, converts as torch on the CPU
does, and says so; the file holds the CPU results.

Run: python3 tests/golden/gen_fp8_golden.py [out_dir]   (needs torch, safetensors)
"""
import math
import pathlib
import struct
import sys

import torch
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "fp8"


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def main():
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    to_f32 = patterns.to(torch.float32)

    finite = to_f32[:0x7F]  # 0x00 .. 0x7e, ascending
    mid = (finite[:-1] + finite[1:]) / 2  # exact in f32
    inf = torch.full_like(mid, math.inf)
    # Ties, and the f32 values one ulp below and above each.
    edge = [mid, torch.nextafter(mid, -inf), torch.nextafter(mid, inf)]
    v464 = torch.tensor([464.0])
    edge.append(torch.tensor([448.0, 464.0, 479.9, 480.0, 1e30, math.inf, math.nan,
                              f32(0x00000001), f32(0x007FFFFF), 2.0 ** -10, 2.0 ** -11, 0.0]))
    edge.append(torch.nextafter(v464, torch.tensor([math.inf])))
    edge = torch.cat(edge)
    edge = torch.cat([edge, -edge])
    g = torch.Generator().manual_seed(8)
    bits = torch.randint(0, 2 ** 32, (4096,), generator=g, dtype=torch.int64)
    exps = torch.randint(113, 137, (4096,), generator=g, dtype=torch.int64)
    rnd = ((bits & 0x807FFFFF) | (exps << 23)).tolist()
    rnd_f = torch.tensor([f32(b) for b in rnd], dtype=torch.float32)
    inputs = torch.cat([edge, rnd_f])
    from_f32 = inputs.to(torch.float8_e4m3fn)

    if torch.cuda.is_available():
        cuda_from = inputs.cuda().to(torch.float8_e4m3fn).cpu()
        cuda_to = patterns.cuda().to(torch.float32).cpu()
        same_from = torch.equal(cuda_from.view(torch.uint8), from_f32.view(torch.uint8))
        same_to = torch.equal(cuda_to.view(torch.int32), to_f32.view(torch.int32))
        print(f"torch {torch.__version__} on CUDA: f32 -> e4m3 "
              f"{'same as' if same_from else 'DIFFERS from'} the CPU, e4m3 -> f32 "
              f"{'same as' if same_to else 'DIFFERS from'} the CPU")
    else:
        print(f"torch {torch.__version__}: no CUDA here, CPU results only")

    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.mkdir(parents=True, exist_ok=True)
    save_file({"patterns": patterns, "to_f32": to_f32, "inputs": inputs, "from_f32": from_f32},
              str(out / "e4m3_torch.safetensors"),
              metadata={"torch": torch.__version__})
    print(f"wrote {out / 'e4m3_torch.safetensors'}: {inputs.numel()} inputs")


if __name__ == "__main__":
    main()
