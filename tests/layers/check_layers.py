#!/usr/bin/env python3
"""Checks that no folder includes a header of a layer above it.

The worker's folders form layers, lowest first:

    core -> backend -> comm -> loader -> parallel
         -> models | encoders | vae | schedulers | media
         -> pipelines -> runtime -> serve -> tools

A file may include headers of its own folder and of lower layers; folders of
one layer do not include each other. The daemon and the client are programs
that schedule and talk: they may include core, loader, parallel, serve and
the generated protocol headers, never a backend, a model or a pipeline.

    check_layers.py SOURCE_ROOT        exit 0 when clean, 1 listing each breach
"""
import os
import re
import sys

LAYERS = [
    ["core"],
    ["backend"],
    ["comm"],
    ["loader"],
    ["parallel"],
    ["models", "encoders", "vae", "schedulers", "media"],
    ["pipelines"],
    ["runtime"],
    ["serve"],
    ["tools"],
]
LEVEL = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}
# What the coordinator and the client may see of the worker tree.
PROGRAM_ALLOWED = {
    "daemon": {"core", "loader", "parallel", "serve"},
    "client": {"core"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"', re.M)


def sources(root):
    for base, _, files in os.walk(root):
        for f in files:
            if f.endswith((".c", ".h", ".cu", ".cuh")):
                yield os.path.join(base, f)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src = sys.argv[1]
    breaches = []
    for path in sources(os.path.join(src, "worker")):
        rel = os.path.relpath(path, os.path.join(src, "worker"))
        own = rel.split(os.sep)[0]
        if own not in LEVEL:
            breaches.append(f"worker/{rel}: folder '{own}' has no layer (add it to {__file__})")
            continue
        with open(path, encoding="utf-8") as fh:
            for m in INCLUDE.finditer(fh.read()):
                dep = m.group(1)
                if dep == own or dep not in LEVEL:
                    continue
                if LEVEL[dep] >= LEVEL[own]:
                    breaches.append(f"worker/{rel}: includes {dep}/ (layer {LEVEL[dep]}) from "
                                    f"{own}/ (layer {LEVEL[own]})")
    for prog, allowed in PROGRAM_ALLOWED.items():
        for path in sources(os.path.join(src, prog)):
            rel = os.path.relpath(path, src)
            with open(path, encoding="utf-8") as fh:
                for m in INCLUDE.finditer(fh.read()):
                    dep = m.group(1)
                    if dep in LEVEL and dep not in allowed:
                        breaches.append(f"{rel}: {prog} includes worker/{dep}/")
    for b in breaches:
        print(b)
    print(f"{len(breaches)} include(s) against the layer order")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
