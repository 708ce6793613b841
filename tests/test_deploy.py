"""deploy/: the manifests parse and agree with the code (the resources the placement options name
are the ones the node groups carry; the flags and config keys they use are accepted), and every
command deploy/README.md shows exists and accepts the flags shown."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router import config_file, effective_options
from router.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def load(rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / rel).read_text()) if d is not None]


def serve_line(text: str) -> list[str]:
    """The `pdserve serve ...` command inside a shell line, as argv after `pdserve`."""
    m = re.search(r"pdserve (serve[^&>;\n]*)", text)
    assert m, text
    return shlex.split(m.group(1))


def effective(argv: list[str], config_text: str | None = None, tmp: Path | None = None) -> dict:
    """The options `pdserve <argv>` would serve with; a config path is read from `config_text`
    (the file as the manifest ships it) when given."""
    args = build_parser().parse_args(argv)
    if config_text is not None:
        assert tmp is not None
        path = tmp / "config.yaml"
        path.write_text(config_text)
        args.config = path
    return dict(effective_options.resolve(args).values)


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 6
    for f in files:
        assert list(yaml.safe_load_all(f.read_text())), f


def test_the_example_config_is_accepted_whole():
    values = config_file.read_file(DEPLOY / "config.example.yaml")
    assert values["prefill_resources"] == {"pdserve_prefill": 1.0}
    assert values["decode_resources"] == {"pdserve_decode": 1.0}
    assert values["ray_address"] == "auto"


def test_ray_up_groups_carry_the_resources_the_config_names(tmp_path):
    (cluster,) = load("ray/cluster.yaml")
    config = config_file.read_file(DEPLOY / "config.example.yaml")
    types = cluster["available_node_types"]
    assert set(types) == {"head", "prefill_gpu", "decode_gpu"}
    assert cluster["head_node_type"] == "head"
    assert set(config["prefill_resources"]) <= set(types["prefill_gpu"]["resources"])
    assert set(config["decode_resources"]) <= set(types["decode_gpu"]["resources"])
    assert not types["head"]["resources"]  # no worker lands on the router's node
    for remote, local in cluster["file_mounts"].items():
        assert (ROOT / local).exists(), (remote, local)
    # The head starts the router with the mounted config: the command parses, the file too.
    (cmd,) = [c for c in cluster["head_start_ray_commands"] if "pdserve serve" in c]
    mounted = (ROOT / cluster["file_mounts"]["~/pdserve.yaml"]).read_text()
    values = effective(serve_line(cmd), mounted, tmp_path)
    assert values["ray_address"] == "auto"
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    validate_config(fillout_defaults(cluster))  # what `ray up` checks first (its schema)


def kuberay_groups() -> dict[str, dict]:
    (rc,) = load("kuberay/raycluster.yaml")
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]} | {
        "head": rc["spec"]["headGroupSpec"]
    }


def router_objects() -> dict[str, dict]:
    return {d["kind"]: d for d in load("kuberay/router.yaml")}


def test_kuberay_groups_carry_the_resources_and_gpus_the_router_config_names(tmp_path):
    groups = kuberay_groups()
    assert set(groups) == {"head", "prefill-gpu", "decode-gpu"}
    config_text = router_objects()["ConfigMap"]["data"]["config.yaml"]
    config = effective(["serve"], config_text, tmp_path)
    for group, key in (("prefill-gpu", "prefill_resources"), ("decode-gpu", "decode_resources")):
        g = groups[group]
        params = g["rayStartParams"]
        # KubeRay passes the value to `ray start --resources` as written: a quoted JSON object.
        declared = json.loads(json.loads(params["resources"]))
        assert set(config[key]) <= set(declared), (group, declared)
        assert all(declared[k] >= v for k, v in config[key].items())
        (container,) = g["template"]["spec"]["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == int(params["num-gpus"]) >= config["gpus_per_worker"] == 1
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"


def test_the_router_manifest_runs_a_command_the_cli_accepts_and_exposes_its_ports(tmp_path):
    objs = router_objects()
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    script = " ".join(container["args"])
    values = effective(serve_line(script), objs["ConfigMap"]["data"]["config.yaml"], tmp_path)
    assert values["ray_address"] == "auto" and values["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": values["port"], "http": values["http_port"], "metrics": values["metrics_port"],
    }  # fmt: skip
    # The admin port stays on the pod's loopback: a port-forward reaches it, no pod IP does.
    assert values["admin_host"] == "127.0.0.1" and values["admin_port"] == 50052
    # The Service exposes gRPC, HTTP and metrics, never the admin port.
    service = objs["Service"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "http", "metrics"}
    labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert container["readinessProbe"]["grpc"]["port"] == values["port"]
    # It joins the RayCluster through the head Service KubeRay makes for `pdserve`.
    assert "ray start --address=pdserve-head-svc:6379" in script
    mount = container["volumeMounts"][0]["mountPath"]
    assert f"--config {mount}/config.yaml" in script
    (monitor,) = load("kuberay/podmonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def readme_commands() -> list[str]:
    text = (DEPLOY / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


_HELP: dict[str, str] = {}


def ray_help(sub: str) -> str:
    if sub not in _HELP:
        ray = str(Path(sys.executable).parent / "ray")
        out = subprocess.run([ray, sub, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"`ray {sub}` does not exist: {out.stderr}"
        _HELP[sub] = out.stdout
    return _HELP[sub]


@pytest.mark.timeout(120)
def test_every_command_in_the_deploy_readme_exists_and_accepts_its_flags():
    commands = readme_commands()
    tools = {c.split()[0] for c in commands}
    assert tools == {"pdserve", "ray", "kubectl", "docker", "promtool"}, tools
    for line in commands:
        argv = shlex.split(line)
        tool, rest = argv[0], argv[1:]
        if tool == "pdserve":
            try:
                args = build_parser().parse_args(rest)
            except SystemExit as exc:
                raise AssertionError(f"pdserve refuses: {line}") from exc
            if rest[0] == "serve":  # its config file exists and is accepted
                if args.config is not None:
                    args.config = ROOT / args.config
                effective_options.resolve(args)
        elif tool == "ray":
            help_text = ray_help(rest[0])
            for flag in (a.split("=")[0] for a in rest if a.startswith("--")):
                assert flag in help_text, f"ray {rest[0]} has no {flag}"
            files = [a for a in rest[1:] if a.endswith(".yaml")]
            assert all((ROOT / f).exists() for f in files), line
        else:  # kubectl, docker, promtool: the files they are given exist
            files = [a for a in rest if a.endswith((".yaml", ".yml")) or "Dockerfile" in a]
            assert files or tool == "kubectl" or rest[0] == "push", line
            assert all((ROOT / f).exists() for f in files), line


def test_an_upgrade_moves_every_pod_to_one_version_and_a_restart_drains_first():
    """The router refuses workers that run other code than its own (worker_protocol/code_id.py):
    every image is pdserve's version, the same in the RayCluster and the router; the old router
    stops before the new one asks for GPUs; a second `ray up` drains the running router before
    `ray stop` kills its workers."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (rc,) = load("kuberay/raycluster.yaml")
    pods = [g["template"]["spec"] for g in kuberay_groups().values()]
    router = router_objects()["Deployment"]["spec"]
    specs = [*pods, router["template"]["spec"]]
    images = {c["image"] for spec in specs for c in spec["containers"]}
    assert {i.rsplit(":", 1)[1] for i in images} == {version}, images
    assert len(images) == 1, images
    assert router["strategy"] == {"type": "Recreate"}
    for spec in pods:  # Ray's object store in memory, not the container's 64 MB default
        (c,) = spec["containers"]
        shm = {v["name"] for v in spec["volumes"] if v.get("emptyDir") == {"medium": "Memory"}}
        assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in c["volumeMounts"])
    groups = rc["spec"]["workerGroupSpecs"]
    if any(g["maxReplicas"] > g["replicas"] for g in groups):  # resizes past the pods started
        assert rc["spec"]["enableInTreeAutoscaling"] is True
    # `ray up`: Ray's image of the version the RayCluster and the Dockerfile name.
    (cluster,) = load("ray/cluster.yaml")
    base = re.search(r"^FROM (\S+)", (DEPLOY / "docker" / "Dockerfile").read_text(), re.M)
    assert base is not None and cluster["docker"]["image"] == base.group(1)
    assert base.group(1).startswith(f"rayproject/ray:{rc['spec']['rayVersion']}-")
    cmds = cluster["head_start_ray_commands"]
    stop = next(i for i, c in enumerate(cmds) if c.strip() == "ray stop")
    assert any("kill -INT" in c and "pdserve.pid" in c for c in cmds[:stop]), cmds
    assert "echo $! > ~/pdserve.pid" in next(c for c in cmds if "pdserve serve" in c)


@pytest.mark.timeout(60)
def test_a_second_ray_up_drains_the_running_router_before_it_restarts_ray(tmp_path):
    """The head's first start command, run by bash as `ray up` runs it, against a stand-in
    router started as the last command starts it (in the background, by a shell that exits)
    that takes 2 s to drain on SIGINT: the command returns once it has exited, and the pid
    file is gone; with no router running it does nothing and fails nothing."""
    import os
    import time

    (cluster,) = load("ray/cluster.yaml")
    cmds = cluster["head_start_ray_commands"]
    stop_router, start_router = cmds[0], cmds[-1]
    # Never a `ray stop` here: it would stop every Ray runtime on this machine.
    assert "kill -INT" in stop_router and "ray " not in stop_router, stop_router
    assert "pdserve serve" in start_router and "ray " not in start_router, start_router
    env = {**os.environ, "HOME": str(tmp_path)}
    stand_in = tmp_path / "router.py"
    stand_in.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: (time.sleep(2), sys.exit(0)))\n"
        f"pathlib.Path({str(tmp_path / 'up')!r}).touch()\n"
        "time.sleep(60)\n"
    )
    start = start_router.replace(
        start_router[start_router.index("pdserve serve") : start_router.index(" >")],
        f"{sys.executable} {stand_in}",
    )
    subprocess.run(["bash", "-c", start], env=env, timeout=30, check=True)
    pid = int((tmp_path / "pdserve.pid").read_text())
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "up").exists():  # its SIGINT handler is set
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        done = subprocess.run(["bash", "-c", stop_router], env=env, timeout=30)
        assert done.returncode == 0 and time.monotonic() - t0 >= 2  # waited for its drain
        # Exited: gone, or a zombie its new parent has yet to reap (which the wait takes as
        # exited: a container's first process may never reap it).
        with contextlib.suppress(FileNotFoundError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state == "Z", state
        assert not (tmp_path / "pdserve.pid").exists()
        again = subprocess.run(["bash", "-c", stop_router], env=env, timeout=30)
        assert again.returncode == 0  # nothing running: nothing to do
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
