"""Writes deploy/kuberay/prometheusrule.yaml: the rules of alerts.yml as a PrometheusRule, for
the Prometheus operator (its `spec` is alerts.yml's content). Edit alerts.yml, then run:

    python deploy/prometheus/make_rule.py

A test fails when prometheusrule.yaml is not what this script writes.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "kuberay" / "prometheusrule.yaml"
HEADER = """\
# Written by deploy/prometheus/make_rule.py from deploy/prometheus/alerts.yml: edit that file.
# The Prometheus operator's form of pdserve's alert rules (the job label is set by
# podmonitor.yaml):
#
#   kubectl apply -f deploy/kuberay/prometheusrule.yaml
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: pdserve
spec:
"""


def render() -> str:
    rules = (HERE / "alerts.yml").read_text().splitlines()
    body = [line for line in rules if not line.startswith("#")]  # its header is for Prometheus
    return HEADER + "".join(f"  {line}\n" if line else "\n" for line in body)


if __name__ == "__main__":
    OUT.write_text(render())
