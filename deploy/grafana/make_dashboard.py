"""Writes deploy/grafana/pdserve.json, the Grafana dashboard for pdserve (import it as is; it
asks for a Prometheus data source). Edit the panels here, then run:

    python deploy/grafana/make_dashboard.py

A test fails when pdserve.json is not what this script writes, and evaluates every expression
in it against a real Prometheus server.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("pdserve.json")
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(name: str, expr: str) -> tuple[str, str]:
    return name, expr


def pct(metric: str, quantile: float) -> str:
    return (
        f"histogram_quantile({quantile}, sum by (le, path) "
        f"(rate({metric}_bucket[$__rate_interval])))"
    )


# (title, unit, [(legend, expr), ...]) in rows of two.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Time to first token at the router (a streaming client's)",
        "s",
        [
            q("p50 {{path}}", pct("pdserve_time_to_first_token_seconds", 0.5)),
            q("p99 {{path}}", pct("pdserve_time_to_first_token_seconds", 0.99)),
        ],
    ),
    (
        "Inter-token latency",
        "s",
        [
            q("p50 {{path}}", pct("pdserve_inter_token_latency_seconds", 0.5)),
            q("p99 {{path}}", pct("pdserve_inter_token_latency_seconds", 0.99)),
        ],
    ),
    (
        "Throughput",
        "short",
        [
            q(
                "output tok/s {{path}}",
                "sum by (path) (rate(pdserve_generation_tokens_total[$__rate_interval]))",
            ),
            q(
                "requests/s {{path}}",
                "sum by (path) (rate(pdserve_requests_total[$__rate_interval]))",
            ),
        ],
    ),
    (
        "Path mix and reasons",
        "reqps",
        [
            q(
                "{{path}}: {{reason}}",
                "sum by (path, reason) (rate(pdserve_path_decisions_total[$__rate_interval]))",
            )
        ],
    ),
    (
        "KV transfers: traffic and bytes per second of send time",
        "Bps",
        [
            q("traffic", "sum(rate(pdserve_kv_transfer_bytes_total[$__rate_interval]))"),
            q(
                "per second of send time",
                "sum(rate(pdserve_kv_transfer_bytes_total[$__rate_interval])) / "
                "sum(rate(pdserve_kv_transfer_seconds_sum[$__rate_interval]))",
            ),
        ],
    ),
    (
        "KV transfers: time and failures",
        "short",
        [
            q(
                "p50 seconds",
                "histogram_quantile(0.5, sum by (le) "
                "(rate(pdserve_kv_transfer_seconds_bucket[$__rate_interval])))",
            ),
            q(
                "failures/s {{reason}}",
                "sum by (reason) (rate(pdserve_kv_transfer_failures_total[$__rate_interval]))",
            ),
        ],
    ),
    (
        "Disaggregated requests prefilled on their decode worker (fallbacks), or again on "
        "another prefill worker (re-plans)",
        "reqps",
        [
            q(
                "{{reason}}",
                "sum by (reason) (rate(pdserve_local_prefill_fallbacks_total[$__rate_interval]))",
            ),
            q("re-planned", "sum(rate(pdserve_prefill_replans_total[$__rate_interval]))"),
        ],
    ),
    (
        "KV cache usage per worker",
        "percentunit",
        [q("{{worker}}", "max by (worker) (pdserve_worker_kv_cache_usage_ratio)")],
    ),
    (
        "Queue depth per worker",
        "short",
        [
            q("waiting {{worker}}", "sum by (worker) (pdserve_worker_requests_waiting)"),
            q("running {{worker}}", "sum by (worker) (pdserve_worker_requests_running)"),
            q(
                "queued prefill tokens {{worker}}",
                "sum by (worker) (pdserve_worker_queued_prefill_tokens)",
            ),
        ],
    ),
    (
        "Admission rejections",
        "reqps",
        [
            q(
                "{{reason}}",
                "sum by (reason) (rate(pdserve_admission_rejections_total[$__rate_interval]))",
            )
        ],
    ),
    (
        "Cost model: TTFT prediction error (abs error / measured)",
        "percentunit",
        [
            q(
                "median {{path}}",
                "histogram_quantile(0.5, sum by (le, path) "
                "(rate(pdserve_ttft_prediction_error_ratio_bucket[$__rate_interval])))",
            ),
        ],
    ),
    (
        "Workers",
        "short",
        [
            q("taking requests {{role}}", "sum by (role) (pdserve_workers)"),
            # Rare events: each point counts the last 5 minutes', whatever the zoom.
            q(
                "failures in 5 m {{worker}}",
                "sum by (worker) (increase(pdserve_worker_failures_total[5m]))",
            ),
            q(
                "of which hung {{worker}}",
                "sum by (worker) (increase(pdserve_worker_hangs_total[5m]))",
            ),
            q(
                "restarts in 5 m {{role}}",
                "sum by (role) (increase(pdserve_worker_restarts_total[5m]))",
            ),
        ],
    ),
    (
        "Prefills per second per worker: for a peer, or local",
        "reqps",
        [
            q(
                "{{worker}} {{kind}}",
                "sum by (worker, kind) (rate(pdserve_worker_prefills_total[$__rate_interval]))",
            ),
        ],
    ),
    (
        "Decodes running per worker",
        "short",
        [q("{{worker}} ({{role}})", "sum by (worker, role) (pdserve_worker_decodes_running)")],
    ),
    (
        "Busy: the share of the time each worker ran steps",
        "percentunit",
        [
            q(
                "{{worker}} ({{role}})",
                "sum by (worker, role) (rate(pdserve_worker_busy_seconds_total[$__rate_interval]))",
            )
        ],
    ),
    (
        "Steps per second run with prompts waiting for short decodes (--prefill-hold-ms)",
        "short",
        [
            q(
                "{{worker}} ({{role}})",
                "sum by (worker, role) "
                "(rate(pdserve_worker_prompt_wait_steps_total[$__rate_interval]))",
            )
        ],
    ),
    (
        "Step slowdown beside a busy peer, per node",
        "short",
        [q("{{node}} beside {{peer}}", "max by (node, peer) (pdserve_node_step_share)")],
    ),
    (
        "How far predictions err lately (sd of ln measured/predicted)",
        "short",
        [q("{{kind}} {{worker}}", "max by (kind, worker) (pdserve_prediction_spread)")],
    ),
    (
        "Measured over predicted p99 gap lately, per worker and kind of placement",
        "short",
        [q("{{worker}} {{kind}}", "max by (kind, worker) (pdserve_prediction_bias_ratio)")],
    ),
    (
        "Inter-token gaps over engine steps, per worker",
        "short",
        [q("{{worker}}", "max by (worker) (pdserve_worker_gap_over_step_ratio)")],
    ),
    (
        "Prefix cache hit rate per worker",
        "percentunit",
        [
            q(
                "{{worker}}",
                "sum by (worker) (rate(pdserve_worker_prefix_cache_hits_tokens_total"
                "[$__rate_interval])) / sum by (worker) "
                "(rate(pdserve_worker_prefix_cache_queries_tokens_total[$__rate_interval]))",
            )
        ],
    ),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": DS,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + j), "datasource": DS, "expr": e, "legendFormat": n}
                    for j, (n, e) in enumerate(queries)
                ],
            }
        )
    return {
        "title": "pdserve",
        "uid": "pdserve",
        "description": "Disaggregated prefill/decode serving: latency by path, transfers, "
        "the router's choices, pools.",
        "editable": True,
        "schemaVersion": 39,
        "tags": ["pdserve", "llm"],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                }
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
