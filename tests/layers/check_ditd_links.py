#!/usr/bin/env python3
"""Checks that ditd links no compute code: no BLAS, cuBLAS(Lt), CUDA runtime or
NCCL among its shared libraries, and no model or BLAS symbols in it.

    check_ditd_links.py PATH_TO_DITD        exit 0 when clean, 1 listing each finding
"""
import re
import subprocess
import sys

LIBS = re.compile(r"(openblas|blas|cublas|cudart|nccl|cudnn)", re.I)
# dit_model_* is the model interface (models/model.h); the daemon's own
# family-neutral description of the served model is dit_model_info_*.
# dit_flux_config_* reads a config.json (JSON only; the probe's).
SYMBOLS = re.compile(r"\b(dit_flux_(?!config_)\w+|cblas_\w+|dit_cpu_\w+|dit_cuda_\w+|dit_model_(?!info_)\w+)\b")


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ditd = sys.argv[1]
    findings = []
    ldd = subprocess.run(["ldd", ditd], capture_output=True, text=True, check=False).stdout
    for line in ldd.splitlines():
        if LIBS.search(line.split("=>")[0]):
            findings.append(f"links {line.strip()}")
    nm = subprocess.run(["nm", ditd], capture_output=True, text=True, check=True).stdout
    for sym in sorted(set(SYMBOLS.findall(nm))):
        findings.append(f"holds symbol {sym}")
    for f in findings:
        print(f"{ditd}: {f}")
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
