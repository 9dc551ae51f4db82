"""Capacity planner: KV cache and concurrency of a Phi-3-vision deployment, before it starts.

Usage::

    python -m serve.plan --model models/phi-3-vision-full            # GPU table, GPU defaults
    python -m serve.plan --model DIR --num-crops 4 --image-share 0.3 --max-model-len 32768
    python -m serve.plan --model models/phi-3-vision-tiny --kv-cache-bytes 268435456 \\
        --block-size 128 --max-model-len 8192 --max-num-seqs 32 --num-crops 1   # the CPU server

``--model`` is a directory with a ``config.json`` (``python -m serve.models.build --size full
--out models/phi-3-vision-full`` writes the full-size one; the builder module is not imported
here because it needs the ``tokenizers`` package, and this module is standard library only).

Everything but :func:`main` is pure arithmetic on the model config and the engine settings;
the formulas follow vLLM 0.32 (V1 engine) and each constant names its unit and source:

- **KV bytes per token** = ``num_hidden_layers x 2 (K and V) x num_key_value_heads x head_dim
  x dtype bytes`` (vLLM's ``FullAttentionSpec.page_size_bytes`` / ``block_size``; the KV
  cache takes the model dtype, ``kv_cache_dtype=auto``). Phi-3-vision: 32 x 2 x 32 x 96 x 2 =
  393,216 B (384 KiB).
- **KV blocks** = ``kv_cache_bytes // (block_size x KV bytes per token)``
  (``kv_cache_utils.get_kv_cache_config_from_groups``); tokens = blocks x ``block_size``, the
  figure the server reads back from vLLM at boot (``num_gpu_blocks x block_size``).
- **KV bytes on a GPU** (``gpu_worker.determine_available_memory``): ``ceil(total x
  gpu_memory_utilization)`` - weights - peak activation of the profile run - non-torch memory
  - CUDA graphs (estimated and subtracted by default since vLLM 0.21:
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``). The CUDA context and NCCL buffers exist
  before vLLM's first memory snapshot, so they come out of the ``1 - gpu_memory_utilization``
  share, not the KV cache.
  With ``--kv-cache-bytes`` (vLLM's ``kv_cache_memory_bytes``, our ``--cpu-kv-cache-bytes``)
  vLLM takes that size as is and profiles nothing.
- **Concurrency without preemption** = ``serve.admission.capacity.kv_safe_seqs`` (the
  server's boot figure, same function) for the mix: ``min(max_num_seqs, kv_tokens //
  tokens_per_request)``; 0 when one ``max_model_len`` request does not fit, because then vLLM
  refuses to start (``kv_cache_utils.check_enough_kv_cache_memory``, which also holds back
  the null block).

It is an estimate for choosing a GPU and settings before a deploy. A running server uses
vLLM's measured KV capacity instead (``GET /admin/autotuner`` -> ``kv_capacity``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from serve.admission.capacity import Mix, kv_safe_seqs, max_image_tokens, tokens_per_request

GiB = 2**30
MiB = 2**20

#: Bytes per element of the dtypes vLLM serves Phi-3-vision in.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: GPU memory sizes of the table, GiB: 16 (T4, V100-16), 24 (A10, L4), 40 (A100-40),
#: 80 (A100-80, H100), 141 (H200). A device reports a little less (an 80 GB H100: 79.2 GiB);
#: ``--gpu-gib`` takes exact figures.
GPU_GIB = (16, 24, 40, 80, 141)

#: Tokens per KV-cache block: vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE`` (GPU backends). The
#: CPU backend uses 128 (``platforms/cpu.py``), so pass ``--block-size 128`` for a CPU server.
BLOCK_SIZE = 16

#: The GPU defaults of ``serve.settings.Settings.resolved`` (not imported: pydantic); a unit
#: test keeps them equal.
GPU_DEFAULTS = {
    "gpu_memory_utilization": 0.90,
    "max_model_len": 131072,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "num_crops": 16,
}

#: Memory vLLM's instance uses outside torch's allocator (cuBLAS/cuBLASLt workspaces, attention
#: backend buffers), bytes: "a few hundred MiB" once the CUDA context and NCCL are excluded
#: (they precede vLLM's memory snapshot in 0.32); 512 MiB is a round, conservative figure.
NON_TORCH_BYTES = 512 * MiB

#: Memory of the captured CUDA graphs, bytes (0 with ``--enforce-eager``). vLLM 0.32 measures
#: it before sizing the KV cache and logs it ("CUDA graph memory profiling ..."); for a 4 B
#: model at the default capture sizes (up to 512 tokens) it is well under 1 GiB, so 1 GiB is a
#: conservative assumption, not a measurement.
CUDA_GRAPH_BYTES = 1 * GiB

#: float32 tensors of ``max_num_seqs x vocab_size`` alive in the profile run's sampler pass
#: (``_dummy_sampler_run``): the logits and the probabilities.
SAMPLER_FLOAT32_COPIES = 2

#: CLIP ViT-L/14-336, Phi-3-vision's image tower (vLLM's ``CLIP_VIT_LARGE_PATCH14_336_CONFIG``;
#: the same numbers as ``serve.models.build``'s ``CLIP_*``, a unit test checks the parameter
#: count against its weight shapes): width, MLP width, patch and image side (pixels), depth.
CLIP_WIDTH, CLIP_MLP, CLIP_PATCH, CLIP_IMAGE, CLIP_DEPTH = 1024, 4096, 14, 336, 24
#: Tokens of one 336-px crop through CLIP: 24 x 24 patches + the class token.
CLIP_TOKENS = (CLIP_IMAGE // CLIP_PATCH) ** 2 + 1


class PlanError(ValueError):
    """A bad input; ``flag`` names the command-line flag (or file) to fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Phi-3(-vision) ``config.json`` the arithmetic needs.

    ``vision_layers`` is 0 for a text-only config (no ``img_processor``).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str
    tied_embeddings: bool = False
    vision_layers: int = 0
    vision_width: int = CLIP_WIDTH
    mlp_projection: bool = True

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def from_config(cls, config: dict, dtype: str | None = None) -> "ModelShape":
        """Read a ``config.json`` dict; ``dtype`` overrides its ``torch_dtype``/``dtype``.

        ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to
        ``hidden_size // num_attention_heads``. CLIP layers: the ones vLLM builds for
        ``img_processor.layer_idx`` (``24 + layer_idx + 1`` when negative, as
        ``phi3v._init_img_processor``).

        Raises:
            PlanError: a missing or non-positive field, or a dtype not in
                :data:`DTYPE_BYTES` (flag ``--dtype``).
        """
        def need(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError("--model", f"config.json needs a positive integer {key!r}, "
                                f"got {value!r}")
            return value

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        name = dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
        if name not in DTYPE_BYTES:
            where = "dtype" if dtype else "config.json's torch_dtype"
            raise PlanError("--dtype", f"{where} {name!r} is not one of "
                            f"{', '.join(DTYPE_BYTES)}; pass --dtype")
        img = config.get("img_processor") or None
        vision_layers = 0
        if img is not None:
            idx = int(img.get("layer_idx", -1))
            vision_layers = CLIP_DEPTH + idx + 1 if idx < 0 else idx + 1
        return cls(
            layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=need("intermediate_size"), vocab=need("vocab_size"), dtype=name,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            vision_layers=vision_layers,
            vision_width=int((img or {}).get("image_dim_out", CLIP_WIDTH)),
            mlp_projection=(config.get("embd_layer") or {}).get("projection_cls",
                                                               "mlp") == "mlp",
        )


def kv_bytes_per_token(shape: ModelShape) -> int:
    """KV-cache bytes of one token: layers x 2 (K, V) x KV heads x head dim x dtype bytes."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * shape.dtype_bytes


@dataclass(frozen=True)
class Parameters:
    """Parameter counts (elements) of the weights vLLM loads."""

    text: int
    vision: int
    projection: int

    @property
    def total(self) -> int:
        return self.text + self.vision + self.projection


def parameter_count(shape: ModelShape) -> Parameters:
    """Parameters from the config, first principles (Phi-3 layout, fused projections).

    - text: ``V·H`` embeddings + per layer ``H·(q + 2·kv)·d`` (qkv_proj) + ``q·d·H`` (o_proj)
      + ``2·I·H`` (gate_up_proj) + ``I·H`` (down_proj) + ``2·H`` (norms), + ``H`` final norm
      + ``V·H`` lm_head (unless tied);
    - vision (CLIP ViT-L/14-336, ``W`` = 1024, ``M`` = 4096, the layers vLLM builds, no
      ``post_layernorm``, which vLLM drops from the truncated tower): ``W`` class embedding +
      ``3·14²·W`` patch embedding + ``577·W`` positions + ``2·W`` pre-norm + per layer
      ``4·(W² + W)`` attention + ``2·2·W`` norms + ``2·M·W + M + W`` MLP;
    - projection (HD transform, 2x2 patches merged to ``4·W``): ``4·W·H + H`` (+ ``H² + H``
      for the 2-layer ``mlp`` projection) + the ``glb_GN``/``sub_GN`` separators ``2·4·W``.

    Phi-3-vision: 3,821,079,552 + 290,909,184 + 22,034,432 = 4,134,023,168 loaded; the
    checkpoint's 24th CLIP layer and post-norm (unused, not loaded) make the published 4.15 B.
    """
    h, d, i, v = shape.hidden, shape.head_dim, shape.intermediate, shape.vocab
    per_layer = (h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h
                 + 2 * i * h + i * h + 2 * h)
    text = v * h + shape.layers * per_layer + h + (0 if shape.tied_embeddings else v * h)
    if not shape.vision_layers:
        return Parameters(text, 0, 0)
    w, m = shape.vision_width, CLIP_MLP
    embeddings = w + 3 * CLIP_PATCH**2 * w + CLIP_TOKENS * w + 2 * w
    clip_layer = 4 * (w * w + w) + 2 * 2 * w + (m * w + m) + (w * m + w)
    projection = 4 * w * h + h + (h * h + h if shape.mlp_projection else 0) + 2 * 4 * w
    return Parameters(text, embeddings + shape.vision_layers * clip_layer, projection)


def weight_bytes(shape: ModelShape) -> int:
    """Bytes of the loaded weights: :func:`parameter_count` x dtype bytes."""
    return parameter_count(shape).total * shape.dtype_bytes


def activation_peak_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                          num_crops: int) -> int:
    """Estimated torch peak of vLLM's profile run over the weights, bytes.

    The profile run (``gpu_model_runner.profile_run``) encodes the most dummy images of the
    largest size the encoder budget holds (``max(1, max_num_batched_tokens //
    max_image_tokens)``, each ``num_crops + 1`` crops of 577 CLIP tokens), then runs the text
    model on ``max_num_batched_tokens`` tokens, then the sampler on ``max_num_seqs`` rows.
    Assumption (simple, conservative): every tensor of one layer is alive at once,

    - text, per token: ``4·H`` (residual, norm output, attention output, layer output) +
      ``(q + 2·kv)·d`` (qkv) + ``3·I`` (gate_up output and the activated half);
    - vision, per CLIP token: ``4·W + 3·W + 2·M`` (the same terms, fc1 and GELU outputs);
    - peak = max(text, vision) x dtype bytes + ``max_num_seqs x vocab x 4 B x``
      :data:`SAMPLER_FLOAT32_COPIES`.

    Check against a measurement: for Llama-3-8B at 8,192 tokens and 256 sequences this gives
    1.24 GiB; vLLM logged "PyTorch activation peak memory 1.26GiB" for it (vLLM PR #10511).
    Attention itself adds nothing here (FlashAttention materialises no score matrix).
    """
    t = max_num_batched_tokens
    text = t * (4 * shape.hidden + (shape.heads + 2 * shape.kv_heads) * shape.head_dim
                + 3 * shape.intermediate)
    vision = 0
    if shape.vision_layers:
        images = max(1, t // max_image_tokens(num_crops))
        w = shape.vision_width
        vision = images * (num_crops + 1) * CLIP_TOKENS * (4 * w + 3 * w + 2 * CLIP_MLP)
    sampler = min(max_num_seqs, t) * shape.vocab * 4 * SAMPLER_FLOAT32_COPIES
    return max(text, vision) * shape.dtype_bytes + sampler


@dataclass(frozen=True)
class Deployment:
    """Engine settings of the plan (defaults: :data:`GPU_DEFAULTS`)."""

    gpu_memory_utilization: float = GPU_DEFAULTS["gpu_memory_utilization"]
    max_model_len: int = GPU_DEFAULTS["max_model_len"]
    max_num_seqs: int = GPU_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = GPU_DEFAULTS["max_num_batched_tokens"]
    num_crops: int = GPU_DEFAULTS["num_crops"]
    block_size: int = BLOCK_SIZE
    enforce_eager: bool = False
    mix: Mix = field(default_factory=Mix)


@dataclass(frozen=True)
class Overheads:
    """What comes off the requested GPU memory before the KV cache, bytes."""

    weights: int
    activation: int
    non_torch: int
    cuda_graphs: int

    @property
    def total(self) -> int:
        return self.weights + self.activation + self.non_torch + self.cuda_graphs


def overheads(shape: ModelShape, dep: Deployment) -> Overheads:
    """Weights, activation peak, non-torch memory and CUDA graphs for ``dep``."""
    return Overheads(
        weights=weight_bytes(shape),
        activation=activation_peak_bytes(shape, dep.max_num_batched_tokens, dep.max_num_seqs,
                                         dep.num_crops),
        non_torch=NON_TORCH_BYTES,
        cuda_graphs=0 if dep.enforce_eager else CUDA_GRAPH_BYTES)


def gpu_kv_cache_bytes(total_bytes: int, shape: ModelShape, dep: Deployment) -> int:
    """KV-cache bytes vLLM would find on a GPU of ``total_bytes`` (0 when nothing is left):
    ``ceil(total x gpu_memory_utilization) - overheads``."""
    requested = math.ceil(total_bytes * dep.gpu_memory_utilization)
    return max(0, requested - overheads(shape, dep).total)


@dataclass(frozen=True)
class Row:
    """One line of the plan.

    Attributes:
        label: the GPU size or the explicit KV size.
        kv_bytes: KV-cache bytes.
        blocks: KV-cache blocks (vLLM's ``num_gpu_blocks``).
        kv_tokens: ``blocks x block_size``.
        max_len_fits: one ``max_model_len`` request fits (else vLLM refuses to start).
        longest_fit: the longest ``max_model_len`` that would fit, tokens.
        concurrency: requests of the mix that fit at once without preemption (0: no start).
        concurrency_at_longest: the same with ``max_model_len`` lowered to ``longest_fit``
            (equal to ``concurrency`` when ``max_model_len`` fits; 0 without a block).
    """

    label: str
    kv_bytes: int
    blocks: int
    kv_tokens: int
    max_len_fits: bool
    longest_fit: int
    concurrency: int
    concurrency_at_longest: int


def plan_row(label: str, kv_bytes: int, shape: ModelShape, dep: Deployment) -> Row:
    """The row for ``kv_bytes`` of KV cache.

    vLLM starts only if the usable blocks (all but the null block) hold ``max_model_len``
    tokens; then the concurrency is :func:`~serve.admission.capacity.kv_safe_seqs` of
    ``blocks x block_size``, as the server computes it at boot.
    """
    blocks = kv_bytes // (dep.block_size * kv_bytes_per_token(shape))
    tokens = blocks * dep.block_size
    longest = max(0, blocks - 1) * dep.block_size
    fits = longest >= dep.max_model_len
    at_longest = kv_safe_seqs(tokens, dep.num_crops, dep.max_num_seqs, dep.mix,
                              min(dep.max_model_len, longest)) if longest else 0
    return Row(label, kv_bytes, blocks, tokens, fits, longest,
               at_longest if fits else 0, at_longest)


def plan_gpus(shape: ModelShape, dep: Deployment,
              gpu_gib: Sequence[float] = GPU_GIB) -> list[Row]:
    """One row per GPU size (GiB), in the order given."""
    return [plan_row(f"{g:g} GiB", gpu_kv_cache_bytes(int(g * GiB), shape, dep), shape, dep)
            for g in gpu_gib]


def render(shape: ModelShape, dep: Deployment, rows: Sequence[Row], model: str = "",
           kv_cache_bytes: int | None = None) -> str:
    """The plan as text: the per-token and per-request figures, then a Markdown table."""
    params = parameter_count(shape)
    per_token = kv_bytes_per_token(shape)
    mix = dep.mix
    per_image = max_image_tokens(dep.num_crops)
    per_request = tokens_per_request(dep.num_crops, mix, dep.max_model_len)
    lines = [
        f"capacity plan for {model or 'the model'} ({shape.dtype}), vLLM 0.32 rules",
        f"parameters: {params.total:,} (text {params.text:,}, vision {params.vision:,}, "
        f"projection {params.projection:,}); weights {weight_bytes(shape) / GiB:.2f} GiB",
        f"KV per token: {per_token:,} B ({per_token / 2**10:g} KiB) = {shape.layers} layers x 2 "
        f"x {shape.kv_heads} KV heads x {shape.head_dim} dims x {shape.dtype_bytes} B; block "
        f"= {dep.block_size} tokens",
        f"tokens per image at num_crops {dep.num_crops}: {per_image:,} (largest)",
        f"tokens per request: {per_request:,} = image share {mix.image_share:g} x "
        f"{mix.images_per_request} image(s) x {per_image:,} + {mix.text_tokens} text"
        + (f" (capped at max_model_len {dep.max_model_len:,})"
           if per_request == dep.max_model_len else ""),
        f"settings: max_model_len {dep.max_model_len:,}, max_num_seqs {dep.max_num_seqs}, "
        f"max_num_batched_tokens {dep.max_num_batched_tokens:,}",
    ]
    if kv_cache_bytes is None:
        o = overheads(shape, dep)
        lines.append(
            f"GPU: gpu_memory_utilization {dep.gpu_memory_utilization:g} minus weights "
            f"{o.weights / GiB:.2f} GiB, activation peak {o.activation / GiB:.2f} GiB "
            f"(estimate, {dep.max_num_batched_tokens:,} batched tokens), non-torch "
            f"{o.non_torch / GiB:.2f} GiB, CUDA graphs {o.cuda_graphs / GiB:.2f} GiB")
    else:
        lines.append(f"KV cache set explicitly: {kv_cache_bytes:,} B (kv_cache_memory_bytes; "
                     "no memory profile)")
    lines += [
        "",
        "| memory | KV cache | KV blocks | KV tokens | max_model_len fits | "
        "requests without preemption |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        fit, seqs = "yes", str(r.concurrency)
        if not r.max_len_fits:
            fit = f"no: vLLM refuses to start (fits <= {r.longest_fit:,})"
            if r.concurrency_at_longest:
                seqs += f" ({r.concurrency_at_longest} at max_model_len {r.longest_fit:,})"
        lines.append(f"| {r.label} | {r.kv_bytes / GiB:.2f} GiB | {r.blocks:,} | "
                     f"{r.kv_tokens:,} | {fit} | {seqs} |")
    return "\n".join(lines)


# --- command line (the only I/O) ---------------------------------------------------------------

def _number(kind: type, low: float, high: float | None = None, low_open: bool = False):
    """An argparse ``type`` that parses ``kind`` and checks ``low <= x <= high`` (``low < x``
    when ``low_open``); the error names the flag (argparse adds it)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            above = f"> {low:g}" if low_open else f">= {low:g}"
            bound = above if high is None else f"{above} and <= {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m serve.plan``."""
    p = argparse.ArgumentParser(
        prog="python -m serve.plan",
        description="KV cache and largest concurrency without preemption of a Phi-3-vision "
        "deployment on vLLM 0.32, per GPU size or for an explicit KV-cache size.")
    d = GPU_DEFAULTS
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory with config.json (python -m serve.models.build "
                   "--size full --out models/phi-3-vision-full writes the full-size one)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                   help="weights and KV dtype; default: the config's torch_dtype")
    p.add_argument("--gpu-memory-utilization", type=_number(float, 0, 1, low_open=True),
                   default=d["gpu_memory_utilization"], help="vLLM's; default %(default)s")
    p.add_argument("--max-model-len", type=_number(int, 1), default=d["max_model_len"],
                   help="context length, tokens; default %(default)s")
    p.add_argument("--max-num-seqs", type=_number(int, 1), default=d["max_num_seqs"],
                   help="batch ceiling; default %(default)s")
    p.add_argument("--max-num-batched-tokens", type=_number(int, 1),
                   default=d["max_num_batched_tokens"],
                   help="token budget of one step (sizes the activation peak); "
                   "default %(default)s")
    p.add_argument("--num-crops", type=_number(int, 1, 16), default=d["num_crops"],
                   help="Phi-3-vision num_crops; default %(default)s")
    p.add_argument("--image-share", type=_number(float, 0, 1), default=1.0,
                   help="fraction of requests with images; default %(default)s")
    p.add_argument("--images-per-request", type=_number(int, 1), default=1,
                   help="images in a request with images; default %(default)s")
    p.add_argument("--text-tokens", type=_number(int, 1), default=Mix().text_tokens,
                   help="prompt text + answer tokens per request; default %(default)s "
                   "(ShareGPT means)")
    p.add_argument("--block-size", type=_number(int, 1), default=BLOCK_SIZE,
                   help="tokens per KV block; default %(default)s (vLLM on GPU; CPU: 128)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (their memory is not subtracted)")
    p.add_argument("--gpu-gib", type=_number(float, 0, low_open=True), nargs="+",
                   default=list(GPU_GIB), metavar="GIB",
                   help="GPU memory sizes of the table, GiB; default %(default)s")
    p.add_argument("--kv-cache-bytes", type=_number(int, 0, low_open=True), metavar="N",
                   help="explicit KV-cache size (vLLM kv_cache_memory_bytes, our "
                   "--cpu-kv-cache-bytes): no GPU table, no memory profile")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Read the model's config.json, print the plan. A bad flag or config exits 2 with a
    message naming the flag."""
    p = parser()
    args = p.parse_args(argv)
    config_path = Path(args.model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        shape = ModelShape.from_config(config, args.dtype)
    except OSError as exc:
        p.error(f"--model: cannot read {config_path}: {exc.strerror or exc}")
    except ValueError as exc:  # PlanError or bad JSON
        p.error(str(exc) if isinstance(exc, PlanError) else f"--model: {config_path}: {exc}")
    dep = Deployment(
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_crops=args.num_crops, block_size=args.block_size, enforce_eager=args.enforce_eager,
        mix=Mix(args.image_share, args.images_per_request, args.text_tokens))
    if args.kv_cache_bytes is not None:
        rows = [plan_row(f"kv_cache_bytes {args.kv_cache_bytes:,}", args.kv_cache_bytes,
                         shape, dep)]
    else:
        rows = plan_gpus(shape, dep, args.gpu_gib)
    print(render(shape, dep, rows, model=args.model, kv_cache_bytes=args.kv_cache_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
