"""Every Prometheus metric pdserve exports, defined in one place (router/metrics.py records
into them): the router's process edge turns the core's records (router/stats.py) and the
workers' load reports into these. Workers open no port of their own; their figures reach here
through the router.

Names follow vLLM's and SGLang's (time_to_first_token_seconds, inter_token_latency_seconds, ...)
under the `pdserve_` prefix, with units in the name. Request latencies carry the label `path`
(colocated | disaggregated); the requests counter and TTFT also `frontend` (grpc | http: the front
door it came in by); worker figures carry `worker` and `role`. One bucket list serves
millisecond ITLs and tens-of-seconds TTFTs alike.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kv_transfer import FailureReason
from router.vocab import FallbackReason, Frontend, RejectReason
from worker_protocol.messages import WorkerRole

REJECT_REASONS = tuple(r.value for r in RejectReason)  # admission's refusals
# 1 ms .. 120 s: ITLs of a few ms to TTFTs of tens of seconds.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
RATIO_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0)
PATH = ("path",)
PATH_FRONTEND = ("path", "frontend")  # the front door: grpc | http
WORKER = ("worker", "role")


class MetricFamilies:
    """The metric families of one router, in their own registry (several routers can share a
    process), each label set that must exist from the start (at 0) created."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str, labels: tuple[str, ...] = PATH) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=LATENCY_BUCKETS)

        self.ttft = hist(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the router to its first token reaching the router's front "
            "door (what a streaming client sees; a whole answer goes out once it has ended), "
            "by path and front door.",
            PATH_FRONTEND,
        )
        self.itl = hist(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive output tokens."
        )
        self.tpot = hist(
            "pdserve_time_per_output_token_seconds",
            "(e2e - TTFT) / (output tokens - 1), per request.",
        )
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue = hist(
            "pdserve_request_queue_time_seconds",
            "Arrival on the worker that prefills the request to its first scheduling there.",
        )
        self.prefill = hist(
            "pdserve_prefill_time_seconds",
            "First scheduling to first token on the prefilling worker.",
        )
        self.transfer = hist("pdserve_kv_transfer_seconds", "One KV send, start to end.", ())
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes sent by prefill workers.", registry=r
        )
        self.transfers = Counter("pdserve_kv_transfers", "KV sends that completed.", registry=r)
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV sends that failed, by reason.",
            ("reason",),
            registry=r,
        )
        self.bandwidth = Gauge(
            "pdserve_kv_transfer_bandwidth_bytes_per_second",
            "Bandwidth of the latest completed KV send.",
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_path_decisions",
            "Path choices, by path and reason.",
            ("path", "reason"),
            registry=r,
        )
        self.prediction_error = Histogram(
            "pdserve_ttft_prediction_error_ratio",
            "abs(predicted - measured) / measured TTFT, per request, by path.",
            PATH,
            registry=r,
            buckets=RATIO_BUCKETS,
        )
        self.predicted_ttft = hist(
            "pdserve_ttft_predicted_seconds",
            "The TTFT the cost model predicted for the path taken.",
        )
        self.rejections = Counter(
            "pdserve_admission_rejections",
            "Requests refused at admission, by reason and front door.",
            ("reason", "frontend"),
            registry=r,
        )
        self.requests = Counter(
            "pdserve_requests",
            "Requests that ran, by path, finish reason and front door.",
            ("path", "finish_reason", "frontend"),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of requests that ran.", PATH, registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens found in a prefix cache.",
            PATH,
            registry=r,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens",
            "Output tokens streamed, as they leave the router.",
            PATH,
            registry=r,
        )
        self.resumed = Counter(
            "pdserve_requests_resumed",
            "Moves of a request to another decode worker after theirs died, hung or left its "
            "pool, counted as they happen (a request moved twice counts 2).",
            registry=r,
        )
        self.running = Gauge(
            "pdserve_worker_requests_running", "Requests in the running batch.", WORKER, registry=r
        )
        self.waiting = Gauge(
            "pdserve_worker_requests_waiting",
            "Requests waiting to be scheduled (or for KV).",
            WORKER,
            registry=r,
        )
        self.kv_usage = Gauge(
            "pdserve_worker_kv_cache_usage_ratio",
            "Fraction of KV blocks in use.",
            WORKER,
            registry=r,
        )
        self.queued_tokens = Gauge(
            "pdserve_worker_queued_prefill_tokens",
            "Prompt tokens not yet computed.",
            WORKER,
            registry=r,
        )
        self.prefix_queries = Counter(
            "pdserve_worker_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache.",
            WORKER,
            registry=r,
        )
        self.prefix_hits = Counter(
            "pdserve_worker_prefix_cache_hits_tokens",
            "Prompt tokens found in the prefix cache.",
            WORKER,
            registry=r,
        )
        self.preemptions = Counter(
            "pdserve_worker_preemptions",
            "Requests preempted (recomputed later).",
            WORKER,
            registry=r,
        )
        self.prompt_wait_steps = Counter(
            "pdserve_worker_prompt_wait_steps",
            "Steps a worker ran its decodes alone while prompts waited for them to end "
            "(--prefill-hold-ms).",
            WORKER,
            registry=r,
        )
        self.busy = Counter(
            "pdserve_worker_busy_seconds",
            "Seconds a worker's engine spent executing steps (the model runner's part, as the host "
            "times it; scheduling and output handling left out). Its rate is the share of the "
            "time the worker was busy, at least: one side of a fixed split idle while the other "
            "is full shows here.",
            WORKER,
            registry=r,
        )
        self.worker_failures = Counter(
            "pdserve_worker_failures",
            "Workers found dead; they leave their pool (and are replaced).",
            WORKER,
            registry=r,
        )
        self.worker_hangs = Counter(
            "pdserve_worker_hangs",
            "Workers whose load polls gave nothing for --worker-hang-timeout (an engine stuck, a "
            "process stopped, a node unreachable): stopped, and (unless a resize was removing "
            "them) replaced and counted in pdserve_worker_failures_total too.",
            WORKER,
            registry=r,
        )
        self.worker_restarts = Counter(
            "pdserve_worker_restarts",
            "Dead workers replaced by a new actor that took load, by role.",
            ("role",),
            registry=r,
        )
        self.live_workers = Gauge(
            "pdserve_workers",
            "Workers taking new requests, by role (no series while the pools start).",
            ("role",),
            registry=r,
        )
        self.prefills = Counter(
            "pdserve_worker_prefills",
            "Prefills placed on a worker: for a peer (its KV handed to another worker's decode), "
            "or local (it answers or decodes the request itself).",
            (*WORKER, "kind"),
            registry=r,
        )
        self.node_share = Gauge(
            "pdserve_node_step_share",
            "How many times slower a worker's steps run while another worker on its node "
            "prefills or decodes (peer), as the router measures it (1: nothing measurable "
            "shared), or its prior until a worker there has run both ways (1.15 beside a "
            "prefill and 1.3 beside a decode on a CPU node, 1 on GPUs); the cost model counts "
            "it where a decode would set an idle worker going.",
            ("node", "peer"),
            registry=r,
        )
        self.prediction_spread = Gauge(
            "pdserve_prediction_spread",
            "How far the router's predictions near their SLO have come from what was measured "
            "lately: the standard deviation of ln(measured / predicted), the width of its miss "
            "chances. kind ttft: first tokens (worker empty); itl_p99: the p99 gap of the "
            "requests that decoded on a worker.",
            ("kind", "worker"),
            registry=r,
        )
        self.gap_factor = Gauge(
            "pdserve_worker_gap_over_step_ratio",
            "How many times longer the inter-token gaps a worker's requests see at the router "
            "are than the steps it runs (medians over the last 30 s): the way of each token out "
            "of the engine and to the router. The cost model predicts steps and multiplies them "
            "by this against ITL SLOs; a worker not yet measured takes the others' median.",
            ("worker",),
            registry=r,
        )
        self.prediction_bias = Gauge(
            "pdserve_prediction_bias_ratio",
            "How many times its prediction the p99 gap of a worker's requests has come lately "
            "(the median of measured / predicted of the last 32 within 5 minutes, within "
            "1/3-3x; with fewer than 5 of the kind, the worker's over both kinds; 1 with fewer "
            "than 5 of those), "
            "by kind: colocated (prefilled on the worker) or received (KV from a peer). The cost "
            "model multiplies its p99 gap predictions of that kind by it.",
            ("kind", "worker"),
            registry=r,
        )
        self.decodes = Gauge(
            "pdserve_worker_decodes_running",
            "Requests decoding on a worker, as the router placed them.",
            WORKER,
            registry=r,
        )
        self.cut_short = Counter(
            "pdserve_requests_cut_short",
            "Requests that ended (finish_reason length) before their max_tokens for a reason "
            "other than the model: kv_cache_capacity, their worker's KV cache could not hold "
            "them. A share of requests_total{finish_reason=length}.",
            ("path", "reason"),
            registry=r,
        )
        self.fallbacks = Counter(
            "pdserve_local_prefill_fallbacks",
            "Disaggregated requests whose prompt was prefilled on their decode worker after "
            "all, by reason.",
            ("reason",),
            registry=r,
        )
        self.pending = Gauge(
            "pdserve_requests_pending",
            "Admitted requests still waiting for their first token (what --max-pending bounds).",
            registry=r,
        )
        self.active = Gauge(
            "pdserve_requests_active", "Admitted requests not yet finished.", registry=r
        )
        self.replans = Counter(
            "pdserve_prefill_replans",
            "Disaggregated requests prefilled again on another prefill worker after theirs died.",
            registry=r,
        )
        # At 0 from the start: the first failure is an increase, and its alert fires.
        for reason in FailureReason:
            self.transfer_failures.labels(reason.value)
        for fb in FallbackReason:
            self.fallbacks.labels(fb.value)
        for why in REJECT_REASONS:
            for door in Frontend:
                self.rejections.labels(why, door.value)
        for role in WorkerRole:
            self.worker_restarts.labels(role.value)
        # pdserve_workers has no series until the pools are up and the core reports them: the
        # metrics port answers while workers start (minutes), when 0 would be no news.
