"""Build Phi-3-vision model directories that vLLM's ``Phi3VForCausalLM`` loads.

Usage::

    python -m serve.models.build --size tiny --out models/phi-3-vision-tiny [--seed 0]
    python -m serve.models.build --size full --out models/phi-3-vision-full
    python -m serve.models.build --real-from weights/Phi-3-vision-128k-instruct \\
        --out models/phi-3-vision-128k-instruct

Every directory holds ``config.json`` (``architectures: ["Phi3VForCausalLM"]``,
``model_type: "phi3_v"``, ``auto_map`` -> our files), ``generation_config.json``,
``preprocessor_config.json``, a tokenizer, and copies of OUR
``configuration_phi3_v.py`` / ``processing_phi3_v.py`` (from
``serve/models/remote_code``), so ``trust_remote_code=True`` only ever runs code
from this repository.

* ``tiny``: hidden 128, 4 heads of 32 (the CPU attention backend supports head
  sizes 32, 64, 80, ..., not 16), 2 layers, 1 CLIP layer (``layer_idx`` 0),
  float32, random weights (seeded normal, std 0.02; norms 1, biases 0) in
  ``model.safetensors`` under the original Hugging Face names; our locally
  built tokenizer (:mod:`serve.models.tokenizer`).
* ``full``: the real microsoft/Phi-3-vision-128k-instruct dimensions, bfloat16,
  ``layer_idx`` -2 (23 CLIP layers), NO weights: serve it with
  ``load_format="dummy"``. The LongRoPE factors are placeholders (see
  :data:`PLACEHOLDER_SHORT_FACTOR`); :func:`prepare_real` takes the real ones.
  vLLM quirk: for LongRoPE configs vLLM defaults ``max_model_len`` to
  ``original_max_position_embeddings`` (4096), not 131072; pass
  ``max_model_len`` explicitly for longer contexts (up to 131072).
* ``--real-from``: :func:`prepare_real`, the full config with the downloaded
  checkpoint's text-model numbers, our code and processor config, and symlinks
  to the downloaded weights and tokenizer files.

Builds are idempotent: a directory whose ``.build_stamp.json`` matches the
request (size, seed, builder sources) is left alone unless ``force``; a new
build is written to a temporary sibling and renamed into place.

A build shows its progress on stderr (tqdm): its steps done of the total (config
files, tokenizer, random weights tensor by tensor, saving them, the swap into
place), with the step running now.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from serve.models import tokenizer as tok

log = logging.getLogger("serve.models.build")

HERE = Path(__file__).resolve().parent
REMOTE_CODE_DIR = HERE / "remote_code"
REMOTE_CODE_FILES = ("configuration_phi3_v.py", "processing_phi3_v.py")
STAMP_FILE = ".build_stamp.json"
WEIGHTS_FILE = "model.safetensors"

CLIP_WIDTH = 1024
"""CLIP ViT-L/14-336 hidden size (vLLM's ``CLIP_VIT_LARGE_PATCH14_336_CONFIG``)."""
CLIP_MLP = 4096
CLIP_PATCH = 14
CLIP_IMAGE = 336
CLIP_POSITIONS = (CLIP_IMAGE // CLIP_PATCH) ** 2 + 1  # 577
CLIP_FULL_DEPTH = 24
DEFAULT_NUM_CROPS = 16
"""``num_crops`` written to preprocessor_config.json (the real checkpoint's value);
vLLM's ``mm_processor_kwargs={"num_crops": K}`` overrides it."""

HEAD_DIM_FULL = 3072 // 32
PLACEHOLDER_SHORT_FACTOR = [1.0] * (HEAD_DIM_FULL // 2)
"""Placeholder LongRoPE short factors (48 x 1.0): the real values are not available offline."""
PLACEHOLDER_LONG_FACTOR = [round(32.0 ** (i / (HEAD_DIM_FULL // 2 - 1)), 6)
                           for i in range(HEAD_DIM_FULL // 2)]
"""Placeholder LongRoPE long factors: a smooth geometric ramp 1.0 -> 32.0 (= 131072 / 4096)
over the 48 rotary frequency pairs. Shape-correct, not the trained values."""

EMBD_LAYER = {
    "embedding_cls": "image",
    "hd_transform_order": "sub_glb",
    "projection_cls": "mlp",
    "use_hd_transform": True,
    "with_learnable_separator": True,
}

SIZES: dict[str, dict] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "layer_idx": 0,
    },
    "full": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": PLACEHOLDER_SHORT_FACTOR,
            "long_factor": PLACEHOLDER_LONG_FACTOR,
        },
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "layer_idx": -2,
    },
}
"""Per-size text-model numbers; see the module docstring."""

REAL_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
    "torch_dtype",
)
"""Fields :func:`prepare_real` takes from the downloaded config.json. Not taken:
``sliding_window`` (131072 in the real file, a no-op at that length),
``auto_map`` (points at Microsoft's torchvision code), ``_attn_implementation``."""

REAL_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REAL_OPTIONAL_FILES = ("special_tokens_map.json", "tokenizer.model", "added_tokens.json")


def clip_layers(layer_idx: int) -> int:
    """CLIP layers vLLM builds for ``img_processor.layer_idx`` (``phi3v._init_img_processor``)."""
    return CLIP_FULL_DEPTH + layer_idx + 1 if layer_idx < 0 else layer_idx + 1


def model_config(size: str) -> dict:
    """The ``config.json`` dict for ``size`` (``"tiny"`` or ``"full"``).

    Raises:
        KeyError: for an unknown size.
    """
    s = SIZES[size]
    return {
        "architectures": ["Phi3VForCausalLM"],
        "model_type": "phi3_v",
        "auto_map": {
            "AutoConfig": "configuration_phi3_v.Phi3VConfig",
            "AutoProcessor": "processing_phi3_v.Phi3VProcessor",
            "AutoImageProcessor": "processing_phi3_v.Phi3VImageProcessor",
        },
        "vocab_size": tok.VOCAB_SIZE,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": s["rms_norm_eps"],
        "rope_theta": s["rope_theta"],
        "rope_scaling": s["rope_scaling"],
        "max_position_embeddings": s["max_position_embeddings"],
        "original_max_position_embeddings": s["original_max_position_embeddings"],
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "torch_dtype": s["torch_dtype"],
        "embd_layer": dict(EMBD_LAYER),
        "img_processor": {
            "image_dim_out": CLIP_WIDTH,
            "model_name": "openai/clip-vit-large-patch14-336",
            "name": "clip_vision_model",
            "num_img_tokens": 144,
            "type_feature": "patch",
            "layer_idx": s["layer_idx"],
        },
    }


def generation_config() -> dict:
    """``generation_config.json``: stop on ``<|endoftext|>`` (32000) and ``<|end|>`` (32007)."""
    return {
        "_from_model_config": False,
        "bos_token_id": 1,
        "eos_token_id": list(tok.EOS_TOKEN_IDS),
        "pad_token_id": 32000,
    }


def preprocessor_config(num_crops: int = DEFAULT_NUM_CROPS) -> dict:
    """``preprocessor_config.json``: our image processor and processor classes."""
    return {
        "auto_map": {
            "AutoImageProcessor": "processing_phi3_v.Phi3VImageProcessor",
            "AutoProcessor": "processing_phi3_v.Phi3VProcessor",
        },
        "image_processor_type": "Phi3VImageProcessor",
        "processor_class": "Phi3VProcessor",
        "num_crops": num_crops,
        "num_img_tokens": 144,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }


def tiny_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint for ``config``, original HF names.

    Text model (Phi-3 layout, fused projections as in the real checkpoint):
    ``model.embed_tokens``, ``model.layers.N.self_attn.qkv_proj`` (q, k, v
    stacked), ``o_proj``, ``mlp.gate_up_proj`` (gate, up stacked),
    ``down_proj``, ``input_layernorm``, ``post_attention_layernorm``,
    ``model.norm``, ``lm_head``. Vision: ``model.vision_embed_tokens.glb_GN``
    (1, 1, 4096), ``sub_GN`` (1, 1, 1, 4096), ``img_projection.0`` (4096 ->
    hidden), ``img_projection.2`` (hidden -> hidden) and the CLIP ViT-L/14-336
    tower ``img_processor.vision_model.*`` with only the layers vLLM builds
    (no ``post_layernorm``, which vLLM drops when the tower is truncated).
    """
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    hd = h // heads
    v = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)

    ve = "model.vision_embed_tokens."
    shapes[ve + "glb_GN"] = (1, 1, 4 * CLIP_WIDTH)
    shapes[ve + "sub_GN"] = (1, 1, 1, 4 * CLIP_WIDTH)
    shapes[ve + "img_projection.0.weight"] = (h, 4 * CLIP_WIDTH)
    shapes[ve + "img_projection.0.bias"] = (h,)
    shapes[ve + "img_projection.2.weight"] = (h, h)
    shapes[ve + "img_projection.2.bias"] = (h,)
    vm = ve + "img_processor.vision_model."
    shapes[vm + "embeddings.class_embedding"] = (CLIP_WIDTH,)
    shapes[vm + "embeddings.patch_embedding.weight"] = (CLIP_WIDTH, 3, CLIP_PATCH, CLIP_PATCH)
    shapes[vm + "embeddings.position_embedding.weight"] = (CLIP_POSITIONS, CLIP_WIDTH)
    shapes[vm + "pre_layrnorm.weight"] = (CLIP_WIDTH,)
    shapes[vm + "pre_layrnorm.bias"] = (CLIP_WIDTH,)
    for i in range(clip_layers(config["img_processor"]["layer_idx"])):
        p = f"{vm}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}self_attn.{proj}.weight"] = (CLIP_WIDTH, CLIP_WIDTH)
            shapes[f"{p}self_attn.{proj}.bias"] = (CLIP_WIDTH,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}{norm}.weight"] = (CLIP_WIDTH,)
            shapes[f"{p}{norm}.bias"] = (CLIP_WIDTH,)
        shapes[p + "mlp.fc1.weight"] = (CLIP_MLP, CLIP_WIDTH)
        shapes[p + "mlp.fc1.bias"] = (CLIP_MLP,)
        shapes[p + "mlp.fc2.weight"] = (CLIP_WIDTH, CLIP_MLP)
        shapes[p + "mlp.fc2.bias"] = (CLIP_WIDTH,)
    return shapes


def random_weights(config: dict, seed: int = 0, progress: bool = False) -> dict:
    """Seeded random float32 tensors for :func:`tiny_weight_shapes`.

    Matrices, embeddings and separators: normal(0, 0.02); norm weights: 1;
    biases: 0. Generated in sorted-name order from ``torch.Generator(seed)``,
    so the same seed gives bit-identical weights. ``progress``: a bar of the
    tensors done on stderr, removed when done.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    items = sorted(tiny_weight_shapes(config).items())
    if progress:
        items = _bar(items, desc="random weights", unit="tensor", leave=False)
    for name, shape in items:
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name or "layrnorm" in name
        if leaf == "bias":
            t = torch.zeros(shape)
        elif is_norm:
            t = torch.ones(shape)
        else:
            t = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        out[name] = t.contiguous()
    return out


def _bar(iterable=None, **kwargs):
    """A tqdm progress bar on stderr (tqdm's defaults otherwise)."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, **kwargs)


def _source_digest() -> str:
    """Hash of the builder's own sources: a stamp from older code never matches."""
    h = hashlib.sha256()
    sources = [Path(__file__), Path(tok.__file__),
               *(REMOTE_CODE_DIR / f for f in REMOTE_CODE_FILES)]
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _read_stamp(out: Path) -> dict | None:
    try:
        return json.loads((out / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _copy_remote_code(dst: Path) -> None:
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, dst / name)


def _install(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``tmp`` (same filesystem, near-atomic).

    ``mkdtemp`` (and safetensors) create owner-only modes; give the tree the
    usual umask-derived modes first so other users/processes can read it.
    """
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for path in tmp.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _check_replaceable(out: Path, force: bool) -> None:
    """Refuse to replace a non-empty directory this tool did not build (unless ``force``)."""
    if out.exists() and not force and _read_stamp(out) is None:
        if not out.is_dir() or any(out.iterdir()):
            raise FileExistsError(
                f"{out} exists and was not built by serve.models.build (no {STAMP_FILE}); "
                "pass --force to replace it"
            )


def build(size: str, out: str | Path, seed: int = 0, force: bool = False,
          num_crops: int = DEFAULT_NUM_CROPS) -> Path:
    """Write a model directory of ``size`` (``"tiny"`` or ``"full"``) at ``out``.

    Args:
        size: ``"tiny"`` (random weights) or ``"full"`` (config only; serve
            with ``load_format="dummy"``).
        out: target directory (created; parents too).
        seed: random-weight seed (tiny only).
        force: rebuild even if the stamp matches; replace a foreign directory.
        num_crops: default ``num_crops`` in preprocessor_config.json.

    Returns:
        ``out`` as a ``Path``.

    Raises:
        ValueError: unknown size.
        FileExistsError: ``out`` is a non-empty directory without our stamp
            and ``force`` is false.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out)
    stamp = {"kind": size, "seed": seed if size == "tiny" else None, "num_crops": num_crops,
             "sources": _source_digest()}
    config = model_config(size)

    weights: dict = {}

    def save_weights(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        weights.clear()

    steps = [("tokenizer", lambda tmp: tok.save_tokenizer(
        tmp, model_max_length=config["max_position_embeddings"]))]
    if size == "tiny":
        steps += [("random weights", lambda tmp: weights.update(random_weights(config, seed,
                                                                               progress=True))),
                  (f"saving {WEIGHTS_FILE}", save_weights)]
    if _write_model_dir(out, stamp, config, num_crops, force, steps, f"{size} model"):
        log.info("built %s model at %s", size, out)
    return out


def _write_model_dir(out: Path, stamp: dict, config: dict, num_crops: int, force: bool,
                     steps: list, what: str) -> bool:
    """Stage a model directory next to ``out`` and swap it in; False when already up to date.

    Writes config.json, generation_config.json, preprocessor_config.json, our remote code and
    the build stamp; ``steps`` (``(name, fn)`` pairs, ``fn(tmp)``) add the rest (tokenizer,
    weights or links). A progress bar on stderr, ``building WHAT``, counts the steps.
    """
    if not force and _read_stamp(out) == stamp:
        log.info("%s is up to date (%s)", out, stamp)
        return False
    _check_replaceable(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))

    def write_configs(tmp: Path) -> None:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config())
        _write_json(tmp / "preprocessor_config.json", preprocessor_config(num_crops))
        _copy_remote_code(tmp)

    def finish(tmp: Path) -> None:
        _write_json(tmp / STAMP_FILE, stamp)
        _install(tmp, out)

    steps = [("config files", write_configs), *steps, ("moving into place", finish)]
    try:
        with _bar(total=len(steps), desc=f"building {what}", unit="step") as bar:
            for name, fn in steps:
                bar.set_postfix_str(name)
                fn(tmp)
                bar.update()
            bar.set_postfix_str("done")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _real_weight_files(weights_dir: Path) -> tuple[list[str], list[str]]:
    """``(present weight/index file names, missing names)`` of a downloaded checkpoint."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (weights_dir / s).is_file()]
        return [index.name, *shards], missing
    found = sorted(p.name for p in weights_dir.glob("*.safetensors"))
    return found, ([] if found else ["*.safetensors (or model.safetensors.index.json)"])


def prepare_real(weights_dir: str | Path, out_dir: str | Path, force: bool = False,
                 num_crops: int = DEFAULT_NUM_CROPS) -> Path:
    """Make a servable directory for the downloaded microsoft/Phi-3-vision-128k-instruct.

    ``out_dir`` gets our full-size ``config.json`` with the text-model fields
    of :data:`REAL_TEXT_FIELDS` (incl. the real ``rope_scaling`` LongRoPE
    factors) taken from ``weights_dir/config.json``; our
    ``generation_config.json``, ``preprocessor_config.json`` and remote code;
    and *relative* symlinks to the downloaded ``*.safetensors`` (+ index) and
    tokenizer files, so the pair of directories can be mounted anywhere (a
    container, a volume) as long as both keep their relative places
    (``deploy/README.md``: ``models/`` and ``weights/`` side by side). No
    ``.py`` file of ``weights_dir`` is ever copied or linked:
    ``trust_remote_code`` runs our code only.

    Args:
        weights_dir: directory holding the downloaded files.
        out_dir: directory to create (replaced if we built it before).
        force: rebuild even if up to date; replace a foreign directory.
        num_crops: default ``num_crops`` in preprocessor_config.json.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileNotFoundError: naming every missing file (config.json, weights,
            tokenizer.json, tokenizer_config.json) when the download is incomplete.
        FileExistsError: see :func:`build`.
    """
    src = Path(weights_dir).resolve()
    out = Path(out_dir)
    weights, missing = _real_weight_files(src) if src.is_dir() else ([], ["*.safetensors"])
    for name in ("config.json", *REAL_TOKENIZER_FILES):
        if not (src / name).is_file():
            missing.append(name)
    if missing:
        raise FileNotFoundError(
            f"Phi-3-vision weights not found in {src}: missing {', '.join(missing)}. "
            "Download microsoft/Phi-3-vision-128k-instruct there first."
        )
    real = json.loads((src / "config.json").read_text())
    inputs = hashlib.sha256((src / "config.json").read_bytes())
    for name in weights:
        st = (src / name).stat()
        inputs.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    stamp = {"kind": "real", "weights_dir": str(src), "inputs": inputs.hexdigest()[:16],
             "num_crops": num_crops, "sources": _source_digest()}
    config = model_config("full")
    config.update({k: real[k] for k in REAL_TEXT_FIELDS if k in real})

    def add_links(tmp: Path) -> None:
        links = [*weights, *REAL_TOKENIZER_FILES,
                 *(n for n in REAL_OPTIONAL_FILES if (src / n).is_file())]
        # Relative to the final directory (tmp is its sibling, renamed into place).
        rel = Path(os.path.relpath(src, out.resolve()))
        for name in links:
            os.symlink(rel / name, tmp / name)

    if _write_model_dir(out, stamp, config, num_crops, force,
                        [("links to the weights and tokenizer", add_links)], "the real model"):
        log.info("prepared %s from %s", out, src)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (2 on missing weights)."""
    parser = argparse.ArgumentParser(prog="python -m serve.models.build",
                                     description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--size", choices=sorted(SIZES),
                      help="build the tiny (random weights) or full (config-only) model")
    what.add_argument("--real-from", metavar="DIR",
                      help="prepare the downloaded real checkpoint in DIR")
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="random-weight seed (tiny; default 0)")
    parser.add_argument("--num-crops", type=int, default=DEFAULT_NUM_CROPS,
                        help="default num_crops in preprocessor_config.json "
                        f"(default {DEFAULT_NUM_CROPS})")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if the directory is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        if args.real_from:
            out = prepare_real(args.real_from, args.out, force=args.force, num_crops=args.num_crops)
        else:
            out = build(args.size, args.out, seed=args.seed, force=args.force,
                        num_crops=args.num_crops)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info("%s ready in %.1f s", out, time.monotonic() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
