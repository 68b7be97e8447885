"""End-to-end tests of ditd serving on a mesh of emulated GPUs: the cuda
backend and the NCCL comm backend built for the SIMT emulator
(tests/gpu/emu), in ditworker_emu, started by the real ditd with
`--backend cuda --worker ditworker_emu`. Each rank is a process with one
emulated device; NCCL's traffic between them goes through the emulated
NCCL (tests/gpu/emu/nccl_emu.cc). So the NCCL mesh code (comm_nccl.c, the
NCCL id relay through ditd, the cuda backend under ring, Ulysses, tensor
and CFG parallelism, a dead rank's detection and the mesh's rebuild) runs
in every build, with or without a GPU; one GPU could not run it anyway
(NCCL refuses two ranks on one device).

    test_cuda_mesh_emu.py CASE      runs one case (meson registers each as a test)
    test_cuda_mesh_emu.py --list    lists the cases
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ditapi  # noqa: E402
from daemon import children_of, env_path, Daemon, generate_queued, run_cases, WAN_DEMO  # noqa: E402
from test_throughput import (run_concurrently, solo_results, wait_meshes_ready,  # noqa: E402
                             wait_progress)
from test_lora import lora_dir  # noqa: E402
from test_video import read_safetensors, reference_case, REF, request_of  # noqa: E402

RAW = "OUTPUT_FORMAT_RAW_TENSOR"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# 64 image tokens, 16 text tokens: seconds a generation on the emulator.
REQ = dict(prompt="a red fox in the snow", width=128, height=64, num_inference_steps=3,
           seed=1, max_sequence_length=16, output_format=RAW)
# 9 image tokens (48 x 48): uneven over two ranks, for the "anything" modes,
# whose exchanges have uneven blocks (all_gather_v, all_to_all_v).
ODD_REQ = dict(REQ, width=48, height=48)
# True CFG, for --cfg-parallel.
CFG_REQ = dict(REQ, negative_prompt="blurry", true_cfg_scale=3.0)
# Relative to max|cpu image|, as the GPU suite measures: the cuda backend
# holds weights and GEMM inputs in bf16 (sums in f32); over a whole
# generation the GPU suite allows 5e-2 of diffusers' final latents
# (tests/gpu/test_cuda_golden.c). A layout whose exchange moved a wrong block
# is off by order one.
CUDA_VS_CPU_TOL = 5e-2
EMU_GPU = "SIMT emulator (sm_90 limits)"


def gpus(first, n):
    """ServerInfo's devices for ranks on GPUs first .. first + n - 1."""
    return [f"rank {r}: cuda:{first + r} {EMU_GPU}" for r in range(n)]

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def floats(raw):
    return struct.unpack(f"<{len(raw) // 4}f", raw)


def rel_err(got, ref):
    assert len(got) == len(ref), (len(got), len(ref))
    top = max(abs(x) for x in ref)
    return max(abs(a - b) for a, b in zip(got, ref)) / top


class EmuMesh(Daemon):
    """ditd with the emulated cuda workers on `devices` emulated GPUs (default
    one per rank) in exclusive-process mode, so that two workers given one
    GPU fail as they would on such a GPU; NCCL's files and the devices'
    claims in a directory of the test's own (`share` another's), removed at
    close."""

    def __init__(self, *args, world, devices=None, share=None, **kw):
        self.own_dir = share is None
        self.nccl_dir = share or tempfile.mkdtemp(prefix="ditemu-nccl-")
        env = {k: v for k, v in self.emu_env(devices or world).items()
               if k.startswith("DIT_EMU_")}
        env.update(kw.pop("env", {}))
        super().__init__("--backend", "cuda", "--worker", env_path("DITWORKER_EMU"),
                         "--startup-timeout", "120", *args, world=world, env=env, **kw)

    def emu_env(self, devices):
        """The environment of a worker started by hand (a joiner) on this
        daemon's emulated GPUs."""
        return dict(os.environ, DIT_EMU_DEVICE_COUNT=str(devices), DIT_EMU_NCCL_DIR=self.nccl_dir,
                    DIT_EMU_EXCLUSIVE_DIR=self.nccl_dir, DIT_EMU_NCCL_TIMEOUT_S="60")

    def close(self):
        super().close()
        if self.own_dir:
            shutil.rmtree(self.nccl_dir, ignore_errors=True)


def collect(seen, call):
    """ditapi.collect over the events already read, then the rest."""
    def events():
        yield from seen
        yield from call
    return ditapi.collect(events())


def image(d, req, timeout=300):
    kinds, raw, res = d.generate(timeout=timeout, **req)
    assert kinds[-1] == "result" and res is not None, kinds
    return floats(raw), res


def cpu_reference(req, *args):
    d = Daemon("--threads", "1", *args, world=1)
    try:
        img, _ = image(d, req)
        d.stop()
    finally:
        d.close()
    return img


def layout_matches(args, world, req, ref, single=None):
    d = EmuMesh(*args, world=world)
    try:
        info = d.info()
        assert info.backend == "cuda" and info.world_size == world, info
        assert info.comm == ("nccl" if world > 1 else "none"), info
        assert list(info.devices) == gpus(0, world), info.devices
        t0 = time.monotonic()
        img, res = image(d, req)
        took = time.monotonic() - t0
        err = rel_err(img, ref)
        line = f"  {' '.join(args) or 'one rank'}: cuda vs cpu rel {err:.3g}"
        if single is not None:
            line += f", vs cuda on one rank {rel_err(img, single):.3g}"
        print(f"{line} ({took:.1f} s)")
        assert err <= CUDA_VS_CPU_TOL, f"{args}: {err:.3g} off the cpu backend's image"
        assert not res.warnings, res.warnings
        assert d.info().worker_restarts == 0
        d.stop()
        return img
    finally:
        d.close()


@case
def layouts():
    """A generation on one emulated GPU and on meshes of ring 2, Ulysses 2,
    tensor parallel 2 and ring 2 x Ulysses 2: each within the bf16 bound of
    the cpu backend's image."""
    ref = cpu_reference(REQ)
    single = layout_matches((), 1, REQ, ref)
    for args, world in ((("--ring", "2"), 2), (("--ulysses", "2"), 2), (("--tp", "2"), 2),
                        (("--ring", "2", "--ulysses", "2"), 4)):
        layout_matches(args, world, REQ, ref, single)


@case
def uneven():
    """9 image tokens over two ranks: --ring 2 --ring-anything, --ulysses 2
    --ulysses-anything and --ring 2 --ulysses 2 --unified-anything, whose
    NCCL exchanges carry blocks of different sizes; each within the bf16
    bound of the cpu's image."""
    ref = cpu_reference(ODD_REQ)
    for args, world in ((("--ring", "2", "--ring-anything"), 2),
                        (("--ulysses", "2", "--ulysses-anything"), 2),
                        (("--ring", "2", "--ulysses", "2", "--unified-anything"), 4)):
        layout_matches(args, world, ODD_REQ, ref)


@case
def wan_layouts():
    """Wan 2.1 (the tiny wan_demo pipeline, 9 frames, classic CFG with a
    negative prompt) on emulated meshes of ring 2 and ring 2 x Ulysses 2 (one
    emulated GPU is cuda_wan_emu's): each raw video against diffusers' within
    twice the error diffusers' own pipeline has with bf16 operands
    (wan_demo/bf16_error.json, tests/golden/gen_wan_bf16_error.py; the bound
    test_cuda_wan.c uses)."""
    name = "f9_cfg_neg"
    with open(os.path.join(WAN_DEMO, "bf16_error.json")) as f:
        bound = max(2e-2, 2 * json.load(f)[name]["video"])
    _, want = read_safetensors(REF, f"{name}.video")
    req = request_of(reference_case(name), output_format=RAW)
    for args, world in ((("--ring", "2"), 2), (("--ring", "2", "--ulysses", "2"), 4)):
        d = EmuMesh(*args, world=world, model=WAN_DEMO)
        try:
            t0 = time.monotonic()
            got, res = image(d, req)
            err = rel_err(got, want)
            print(f"  wan {' '.join(args)}: cuda vs diffusers rel {err:.3g} (bound {bound:.3g}, "
                  f"{time.monotonic() - t0:.1f} s)")
            assert err <= bound, f"{args}: {err:.3g} off diffusers' video"
            d.stop()
        finally:
            d.close()


@case
def cfg_parallel():
    """--cfg-parallel: the conditional and unconditional passes on two
    emulated GPUs, one exchange a step."""
    ref = cpu_reference(CFG_REQ)
    layout_matches(("--cfg-parallel",), 2, CFG_REQ, ref)


@case
def batched():
    """--max-batch 3 on an emulated ring of 2: three queued requests (own
    prompts, seeds and guidance, one of two images) run as one batched
    generation; each image equals that request's alone on the same mesh and
    is within the bound of the cpu backend's."""
    members = [dict(prompt="a red fox in the snow", seed=11, guidance_scale=3.5),
               dict(prompt="a lighthouse at dusk", seed=12, guidance_scale=1.5),
               dict(prompt="", seed=13, guidance_scale=6.0, num_images=2)]
    shape = {k: REQ[k] for k in ("width", "height", "num_inference_steps",
                                 "max_sequence_length")}
    cpu = Daemon("--threads", "1", world=1)
    try:
        ref = solo_results(cpu, members, **shape)
        cpu.stop()
    finally:
        cpu.close()
    d = EmuMesh("--ring", "2", "--max-batch", "3", world=2)
    try:
        api = d.api
        alone = solo_results(d, members, **shape)
        blocker = api.generate(d.channel)(
            api.request(seed=1, **dict(shape, num_inference_steps=1000)), timeout=600)
        wait_progress(blocker)
        results, threads = run_concurrently(d, [dict(shape, output_format=RAW, **m)
                                                for m in members])
        blocker.cancel()
        for t in threads:
            t.join(300)
        worst = 0.0
        for k, r in results.items():
            assert not isinstance(r, Exception), f"member {k} failed: {r}"
            images, res = r
            assert res.batch_size == 3 and res.seed == members[k]["seed"], res
            assert len(images) == len(ref[k]), (k, len(images))
            for i, img in enumerate(images):
                err = rel_err(floats(img), floats(ref[k][i]))
                assert err <= CUDA_VS_CPU_TOL, f"member {k} image {i}: {err:.3g} off the cpu's"
                worst = max(worst, err)
                # Bit for bit on the emulator, whose GEMM sums every row
                # alike at any row count (cuBLASLt may pick another
                # algorithm for another M).
                assert img == alone[k][i], f"member {k} image {i} differs from it alone on cuda"
        print(f"  batch of 3 on --ring 2: worst cuda vs cpu alone {worst:.3g}")
        d.stop()
    finally:
        d.close()


@case
def replicas():
    """--replicas 2 of --ring 2 on four emulated GPUs in exclusive-process
    mode: mesh m gets GPUs 2m and 2m + 1 (two workers on one GPU would fail
    to start, as a second daemon on the same GPUs shows), both meshes
    serve, each image within the bound of the cpu's."""
    ref = cpu_reference(REQ)
    d = EmuMesh("--replicas", "2", "--ring", "2", world=2, devices=4)
    try:
        info = wait_meshes_ready(d)
        assert info.replicas == 2 and len(info.meshes) == 2, info
        assert [list(m.devices) for m in info.meshes] == [gpus(0, 2), gpus(2, 2)], info.meshes
        # The first holds mesh 0 (it is running when the second starts), so
        # the second runs on mesh 1.
        api = d.api
        calls = [api.generate(d.channel)(api.request(**REQ), timeout=300)]
        first = []
        for ev in calls[0]:
            first.append(ev)
            if ev.WhichOneof("event") == "started":
                break
        calls.append(api.generate(d.channel)(api.request(**REQ), timeout=300))
        for k, call in enumerate(calls):
            kinds, raw, res = collect(first if k == 0 else [], call)
            assert res is not None, kinds
            err = rel_err(floats(raw), ref)
            assert err <= CUDA_VS_CPU_TOL, f"request {k}: {err:.3g} off the cpu's"
        jobs = [m.jobs for m in d.info().meshes]
        assert jobs == [1, 1], f"the two requests did not run on both meshes: {jobs}"
        print(f"  two requests, one on each mesh: cuda vs cpu {err:.3g}")
        # The same four GPUs again, from another daemon: its workers cannot
        # have them while the first daemon's hold them.
        e = EmuMesh("--ring", "2", world=2, devices=4, share=d.nccl_dir, wait_serving=False)
        try:
            t0 = time.monotonic()
            while "busy or unavailable" not in e.log() and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            assert "busy or unavailable" in e.log(), e.log()
            assert d.info().meshes[0].state == "ready"
        finally:
            e.close()
        d.stop()
    finally:
        d.close()


@case
def join():
    """A mesh across "hosts": rank 0 started by ditd, rank 1 an emulated
    `ditworker --join` on GPU 1 with the shared secret, the NCCL id reaching
    it over the join connection. Its image is within the bound of the cpu's;
    when the local worker dies, the joined one rejoins by itself and the
    rebuilt mesh (a new NCCL id) gives the same image again."""
    ref = cpu_reference(REQ)
    with tempfile.TemporaryDirectory() as tmp:
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("7f3a9c0e5b2d48e1a6c4f0b9d3e7a215\n")
        d = EmuMesh("--ring", "2", "--local-ranks", "1", "--join-listen", "127.0.0.1:0",
                    "--join-secret-file", secret, world=2, wait_serving=False)
        joiner = None
        try:
            with open(os.path.join(tmp, "joiner.log"), "w") as logf:
                joiner = subprocess.Popen(
                    [env_path("DITWORKER_EMU"), "--join", d.join_target, "--secret-file", secret,
                     "--device", "1"], stderr=logf, env=d.emu_env(2))
            d.wait_serving(60)
            info = d.info()
            assert info.world_size == 2 and info.comm == "nccl", info
            assert list(info.devices) == gpus(0, 2), info.devices  # the joiner's --device 1
            img, _ = image(d, REQ)
            err = rel_err(img, ref)
            assert err <= CUDA_VS_CPU_TOL, f"{err:.3g} off the cpu's image"
            local = children_of(d.proc.pid)
            assert len(local) == 1, local
            os.kill(local[0], signal.SIGKILL)
            t0 = time.monotonic()
            while d.info().worker_restarts < 1 and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            d.wait_serving(60)
            assert joiner.poll() is None, "the joined worker exited instead of rejoining"
            again, _ = image(d, REQ)
            assert again == img, "the rebuilt mesh's image differs"
            print(f"  joined rank on GPU 1: cuda vs cpu {err:.3g}; after the local rank's "
                  f"death the rejoined mesh gave the same bits")
            d.stop()
        finally:
            d.close()
            if joiner and joiner.poll() is None:
                joiner.terminate()
                joiner.wait(30)
            with open(os.path.join(tmp, "joiner.log"), errors="replace") as f:
                log = f.read()
            for needle in ("runtime error:", "AddressSanitizer", "LeakSanitizer"):
                assert needle not in log, f"sanitizer report from the joined worker:\n{log}"


@case
def lora_mesh():
    """A LoRA adapter (demo_peft at 0.8) on an emulated tp 2 x ring 2 mesh:
    every rank loads its slice of it in bf16; the image is within the bound
    of the cpu's with the same adapter, and much farther from the cpu's
    without it (so an adapter left out would show)."""
    with tempfile.TemporaryDirectory() as tmp:
        loras = ("--lora-dir", lora_dir(tmp))
        req = dict(REQ, loras=[("demo_peft", 0.8)])
        ref = cpu_reference(req, *loras)
        base = cpu_reference(REQ, *loras)
        d = EmuMesh("--tp", "2", "--ring", "2", *loras, world=4)
        try:
            img, _ = image(d, req)
            err, off = rel_err(img, ref), rel_err(img, base)
            print(f"  demo_peft x 0.8 on tp 2 x ring 2: cuda vs cpu {err:.3g}, vs cpu without "
                  f"the adapter {off:.3g}")
            assert err <= CUDA_VS_CPU_TOL, f"{err:.3g} off the cpu's image with the adapter"
            assert off > 4 * CUDA_VS_CPU_TOL, f"only {off:.3g} from the image without it"
            d.stop()
        finally:
            d.close()


def rank_lost(sig, *args, env=None):
    """Signals rank 1 of an emulated NCCL ring mid-request; returns the
    failed request's details and how long after the signal it failed, once
    the rebuilt mesh (the signalled process gone) has served another."""
    d = EmuMesh("--ring", "2", *args, world=2, env=env or {})
    try:
        api = d.api
        long_req = dict(REQ, num_inference_steps=1000, output_format="OUTPUT_FORMAT_PNG")
        call = api.generate(d.channel)(api.request(**long_req), timeout=600)
        wait_progress(call)
        workers = children_of(d.proc.pid)
        assert len(workers) == 2, workers
        t0 = time.monotonic()
        os.kill(workers[-1], sig)
        try:
            for _ in call:
                pass
            raise AssertionError("the request outlived its rank")
        except grpc.RpcError as e:
            took = time.monotonic() - t0
            assert e.code().name == "UNAVAILABLE", (e.code(), e.details())
            details = e.details()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            info = d.info()
            if info.mesh_state == "ready" and info.worker_restarts == 1:
                break
            time.sleep(0.1)
        assert info.mesh_state == "ready" and info.worker_restarts == 1, info
        assert workers[-1] not in children_of(d.proc.pid)
        kinds, png, res = d.generate(timeout=300, **dict(REQ, output_format="OUTPUT_FORMAT_PNG"))
        assert png.startswith(PNG_MAGIC) and res.seed == 1
        d.stop()
        return details, took
    finally:
        d.close()


@case
def rank_killed():
    """kill -9 of one rank of an emulated NCCL ring mid-request: the request
    fails with UNAVAILABLE naming it, the mesh rebuilds (a new NCCL id
    through ditd) and serves the next request."""
    details, took = rank_lost(signal.SIGKILL)
    assert "rank 1" in details, details
    print(f"  failed {1000 * took:.0f} ms after the kill: {details}")


@case
def rank_stalled():
    """SIGSTOP of one rank of an emulated NCCL ring mid-request: its peer's
    receive times out (--comm-timeout 3, the emulated NCCL's limit the same),
    the request fails with UNAVAILABLE naming the stalled rank as its peer
    saw it, and the rebuilt mesh (the stopped process killed) serves the
    next request."""
    details, took = rank_lost(signal.SIGSTOP, "--comm-timeout", "3",
                              env={"DIT_EMU_NCCL_TIMEOUT_S": "3"})
    assert "nothing from rank 1 within 3 s" in details, details
    print(f"  failed {took:.1f} s after the stop: {details}")


@case
def device_fault():
    """A device fault mid-request on a one-GPU mesh (the emulated GPU's
    sticky illegal address, DIT_EMU_FAULT_FILE): the request fails naming
    the CUDA error and the worker leaves (a CUDA context stays broken after
    such a fault), and the request queued behind it is not handed to that
    worker on its way out (where it failed as soon as its socket closed)
    but waits for the rebuilt mesh, which serves it."""
    fault = os.path.join(tempfile.mkdtemp(prefix="ditemu-fault-"), "fault")
    d = EmuMesh(world=1, env={"DIT_EMU_FAULT_FILE": fault})
    try:
        api = d.api
        call = api.generate(d.channel)(api.request(**dict(REQ, num_inference_steps=1000)),
                                       timeout=600)
        wait_progress(call)
        t, queued = generate_queued(d, **dict(REQ, seed=2))
        workers = children_of(d.proc.pid)
        assert len(workers) == 1, workers
        open(fault, "w").close()
        try:
            for _ in call:
                pass
            raise AssertionError("the request outlived its device")
        except grpc.RpcError as e:
            details = e.details()
        os.unlink(fault)  # the rebuilt mesh's device is a sound one
        assert "cudaErrorIllegalAddress" in details, details
        print(f"  the faulted request: {details}")
        t.join(300)
        r = queued.get("r")
        assert not isinstance(r, grpc.RpcError), \
            f"the queued request failed: {r.code().name}: {r.details()}"
        kinds, raw, res = r
        assert kinds[-1] == "result" and res.seed == 2 and len(raw) == 3 * 128 * 64 * 4, kinds
        info = d.info()
        assert info.worker_restarts == 1, info
        assert workers[0] not in children_of(d.proc.pid)
        d.stop()
    finally:
        d.close()
        shutil.rmtree(os.path.dirname(fault), ignore_errors=True)


def main():
    return run_cases(CASES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
