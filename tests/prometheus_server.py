"""A real Prometheus server (Debian's `prometheus`, which scripts/test.sh installs) scraping a
test's router with the repository's prometheus.yml and alerts.yml: targets rewritten to the test's
metrics port, scrapes and rule evaluations every second, and optionally every alert's `for`
shortened so that a test sees it fire."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found: install Debian's prometheus package (.ci/run does)"
    return path


def api(port: int, query: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def alerts(port: int) -> list[dict]:
    """The alerts Prometheus holds now (pending or firing), with their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=10) as resp:
        return json.load(resp)["data"]["alerts"]


def rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


@contextmanager
def prometheus(metrics_port: int, d: Path, alert_for: str | None = None) -> Iterator[int]:
    """Run Prometheus in `d` against the router's metrics on `metrics_port`; yields its port.
    `alert_for` replaces every alert's `for` (e.g. "0s")."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    for job in cfg["scrape_configs"]:
        if job["job_name"] == "pdserve":
            job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
        else:  # Ray's service discovery: this test's own (empty) file
            (d / "ray_sd.json").write_text("[]")
            job["file_sd_configs"] = [{"files": [str(d / "ray_sd.json")]}]
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    if alert_for is not None:
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule["for"] = alert_for
    (d / "alerts.yml").write_text(yaml.safe_dump(doc))
    port = free_port()
    log = (d / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (d / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        # Ready is not scraping yet: wait for two scrapes of the router, so that what a test
        # does from now on is an increase over values Prometheus already holds.
        while True:
            got = api(port, 'count_over_time(up{job="pdserve"}[1m])')["data"]["result"]
            if got and float(got[0]["value"][1]) >= 2:
                break
            assert time.monotonic() < deadline + 60, "prometheus never scraped the router"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
