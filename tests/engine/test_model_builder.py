"""Tests of ``python -m serve.models.build``: tokenizer, processor, configs, weights, vLLM.

Pure tests check our code against fixed reference numbers (Phi-3-vision image token
counts for the real model: 1500x1000 -> 757 at num_crops=4 and 1921 at 16, a square
image -> 2509 at 16). ``test_tiny_model_runs_in_vllm`` loads the built tiny directory
with the real vLLM engine (CPU) in a subprocess -- this file run as a script with
``--engine-check DIR`` -- and checks the prompts vLLM builds against our formula.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
for _k, _v in OFFLINE_ENV.items():  # before transformers / huggingface_hub read them
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from serve.models import build as builder  # noqa: E402
from serve.models import tokenizer as tk  # noqa: E402
from serve.models.remote_code import processing_phi3_v as proc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT.parent / "shared" / "images"

#: Engine check limit (s). Measured on 2 cores: ~24 s in all (import ~12 s, engine start ~5 s with
#: vLLM's model-inspection cache warm, +12-17 s on a machine's first start; 8 image prompts ~7 s).
ENGINE_TIMEOUT_S = 600
ENGINE_NUM_CROPS = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A freshly built tiny model directory."""
    return builder.build("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory) -> Path:
    """A freshly built full-size (config-only) model directory."""
    return builder.build("full", tmp_path_factory.mktemp("models") / "full")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir):
    """The tiny directory's tokenizer, loaded by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def expected_tokens(width: int, height: int, num_crops: int) -> int:
    """Independent restatement of Phi-3-vision's HD token count (Microsoft's
    ``calc_num_image_tokens_from_image_size``), for checking our module."""
    import math

    transposed = width < height
    w, h = (height, width) if transposed else (width, height)
    ratio = w / h
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * 336)
    new_h = max(1, int(new_w / ratio))
    pad_h = math.ceil(new_h / 336) * 336
    h_tiles, w_tiles = pad_h // 336, new_w // 336
    if transposed:  # rows are counted in the original orientation
        h_tiles, w_tiles = w_tiles, h_tiles
    return (h_tiles * w_tiles + 1) * 144 + 1 + (h_tiles + 1) * 12


def portrait_photo() -> Image.Image:
    """A real photo in portrait orientation (rocket.jpg is 640x427 landscape): 214x640."""
    return (
        Image.open(IMAGES / "rocket.jpg")
        .convert("RGB")
        .transpose(Image.Transpose.ROTATE_90)
        .resize((214, 640))
    )


# --------------------------------------------------------------------------- processor


@pytest.mark.parametrize(
    ("width", "height", "num_crops", "tokens"),
    [
        (1500, 1000, 4, 757),
        (1500, 1000, 16, 1921),
        (1000, 1500, 16, 1933),  # portrait: 4 rows x 3 columns -> (12 + 1) * 144 + 1 + (4 + 1) * 12
        (1000, 1000, 16, 2509),
        (336, 336, 16, 2509),
        (4000, 4000, 16, 2509),
    ],
)
def test_reference_token_counts(width, height, num_crops, tokens):
    ip = proc.Phi3VImageProcessor(num_crops=num_crops)
    assert ip.calc_num_image_tokens_from_image_size(width, height) == tokens


def test_formula_matches_independent_restatement():
    sizes = [
        (1, 1),
        (2000, 8),
        (8, 2000),
        (451, 300),
        (214, 640),
        (336, 335),
        (337, 336),
        (5000, 17),
        (640, 427),
    ]
    for k in (1, 2, 4, 9, 16):
        for w, h in sizes:
            assert proc.Phi3VImageProcessor(num_crops=k).calc_num_image_tokens_from_image_size(
                w, h
            ) == expected_tokens(w, h, k), (w, h, k)


IMAGE_CASES = {
    "landscape": lambda: Image.open(IMAGES / "chelsea.png"),
    "portrait": portrait_photo,
    "one_pixel": lambda: Image.open(IMAGES / "one_pixel.png"),
    "strip": lambda: Image.open(IMAGES / "strip_2000x8.png"),
    "tall_strip": lambda: Image.open(IMAGES / "strip_2000x8.png").transpose(
        Image.Transpose.ROTATE_90
    ),
    "gray16": lambda: Image.open(IMAGES / "gray_16bit.png"),
    "rgba": lambda: Image.open(IMAGES / "coffee_rgba.png"),
}


@pytest.mark.parametrize("num_crops", [1, 4, 16])
@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_processor_shapes(case, num_crops):
    image = IMAGE_CASES[case]()
    ip = proc.Phi3VImageProcessor(num_crops=num_crops)
    out = ip(image)
    pv, sizes = out["pixel_values"], out["image_sizes"]
    assert pv.shape == (1, num_crops + 1, 3, 336, 336) and pv.dtype == torch.float32
    assert sizes.shape == (1, 2) and sizes.dtype == torch.int64
    pad_h, pad_w = sizes[0].tolist()
    assert pad_h % 336 == 0 and pad_w % 336 == 0
    h_tiles, w_tiles = pad_h // 336, pad_w // 336
    assert 1 <= h_tiles * w_tiles <= num_crops
    if image.width < image.height:
        assert pad_h >= pad_w
    elif image.width > image.height:
        assert pad_w >= pad_h
    tokens = (h_tiles * w_tiles + 1) * 144 + 1 + (h_tiles + 1) * 12
    assert (
        ip.calc_num_image_tokens_from_image_size(*image.size)
        == tokens
        == int(out["num_img_tokens"][0])
    )
    used = 1 + h_tiles * w_tiles
    assert torch.count_nonzero(pv[0, used:]) == 0  # zero padding crops
    assert torch.count_nonzero(pv[0, :used].flatten(1), dim=1).min() > 0


def _norm(rgb):
    return [
        (c / 255 - m) / s
        for c, m, s in zip(rgb, proc.OPENAI_CLIP_MEAN, proc.OPENAI_CLIP_STD, strict=False)
    ]


def test_crops_are_row_major_normalised_and_white_padded():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]  # TL, TR, BL, BR
    image = Image.new("RGB", (672, 672))
    for i, c in enumerate(colours):
        image.paste(c, (336 * (i % 2), 336 * (i // 2), 336 * (i % 2 + 1), 336 * (i // 2 + 1)))
    pv = proc.Phi3VImageProcessor(num_crops=4)(image)["pixel_values"][0]
    for i, c in enumerate(colours):
        centre = pv[1 + i, :, 100:236, 100:236]
        assert torch.allclose(
            centre, torch.tensor(_norm(c)).view(3, 1, 1).expand_as(centre), atol=1e-5
        )
    # 672x448 (ratio 1.5) at num_crops=4 -> 672x448 -> padded to 672: 112 white rows on top,
    # 112 below
    out = proc.Phi3VImageProcessor(num_crops=4)(Image.new("RGB", (672, 448), (0, 0, 0)))
    assert out["image_sizes"][0].tolist() == [672, 672]
    first = out["pixel_values"][0, 1]
    white = torch.tensor(_norm((255, 255, 255))).view(3, 1, 1)
    black = torch.tensor(_norm((0, 0, 0))).view(3, 1, 1)
    assert torch.allclose(first[:, :112], white.expand(3, 112, 336), atol=1e-5)
    assert torch.allclose(first[:, 113:336], black.expand(3, 223, 336), atol=1e-5)
    last = out["pixel_values"][0, 3]  # bottom-left crop
    assert torch.allclose(last[:, -112:], white.expand(3, 112, 336), atol=1e-5)


def test_autoprocessor_loads_our_code_with_num_crops(tiny_dir):
    from transformers import AutoProcessor

    p4 = AutoProcessor.from_pretrained(tiny_dir, trust_remote_code=True, num_crops=4)
    p16 = AutoProcessor.from_pretrained(tiny_dir, trust_remote_code=True)
    assert type(p4).__name__ == "Phi3VProcessor"
    assert p4.num_crops == 4 and p16.num_crops == builder.DEFAULT_NUM_CROPS
    assert p4.img_tokens[0] == "<|image_1|>" and p4.img_tokens[99] == "<|image_100|>"
    assert p4.calc_num_image_tokens_from_image_size(1500, 1000) == 757
    assert p16.calc_num_image_tokens_from_image_size(1500, 1000) == 1921
    images = [Image.open(IMAGES / "chelsea.png"), portrait_photo()]
    out = p4(text="<|image_1|>\n<|image_2|>\nDescribe.", images=images, return_tensors="pt")
    assert out["pixel_values"].shape == (2, 5, 3, 336, 336)
    assert out["image_sizes"].shape == (2, 2)
    ids = out["input_ids"][0].tolist()
    assert ids == p4.tokenizer.encode(
        "<|image_1|>\n<|image_2|>\nDescribe.", add_special_tokens=False
    )
    assert tk.IMAGE_TOKEN_ID not in ids  # vLLM expands the placeholders itself


def test_remote_code_is_self_contained(tiny_dir):
    allowed = {"numpy", "torch", "PIL", "transformers"}
    for name in builder.REMOTE_CODE_FILES:
        src = (tiny_dir / name).read_text()
        assert src == (builder.REMOTE_CODE_DIR / name).read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import"
                assert node.module.split(".")[0] in allowed, f"{name}: imports {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in allowed, f"{name}: imports {alias.name}"


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_id_layout(hf_tokenizer):
    tok = hf_tokenizer
    assert len(tok) == tk.VOCAB_SIZE == 32064
    expected = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<|endoftext|>": 32000,
        "<|assistant|>": 32001,
        "<|placeholder1|>": 32002,
        "<|placeholder4|>": 32005,
        "<|system|>": 32006,
        "<|end|>": 32007,
        "<|placeholder5|>": 32008,
        "<|placeholder6|>": 32009,
        "<|user|>": 32010,
        "<|image|>": 32044,
        "<|placeholder58|>": 32063,
    }
    for text, token_id in expected.items():
        assert tok.encode(text, add_special_tokens=False) == [token_id], text
        assert tok.convert_ids_to_tokens(token_id) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        1,
        32000,
        0,
        32000,
    )
    assert tok("hello world").input_ids == tok.encode(
        "hello world", add_special_tokens=False
    )  # no BOS
    assert tok.encode("<s> <|image|>", add_special_tokens=False) == [1, 3 + ord(" "), 32044]
    assert max(tok.get_vocab().values()) == 32063 and len(tok.get_vocab()) == 32064
    assert all(isinstance(tok.decode([i]), str) for i in range(tk.VOCAB_SIZE))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "  leading and trailing spaces  ",
        "<s><|user|>\n<|image_1|>\nWhat is in this image?<|end|>\n<|assistant|>\n",
        "tabs\tand\r\nCRLF\n\n\nand many newlines",
        "Ünïcödé, 日本語, emoji 😀👍🏽, zero\u200bwidth",
        "<|endoftext|><|end|><|image|><|placeholder12|></s><unk>",
        "not special: <|image_12|> <|user |> <s",
        "".join(chr(c) for c in range(32, 127)),
    ],
)
def test_tokenizer_round_trip(hf_tokenizer, text):
    ids = hf_tokenizer(text).input_ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text


def test_chat_template(hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<|image_1|>\nHi"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\n<|image_1|>\nHi<|end|>\n<|assistant|>\n"
    )
    assert hf_tokenizer.decode(hf_tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenizer_build_is_deterministic():
    assert tk.build_tokenizer().to_str() == tk.build_tokenizer().to_str()


# --------------------------------------------------------------------------- configs and weights


def test_tiny_config_and_weights(tiny_dir):
    from safetensors import safe_open
    from transformers import AutoConfig

    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["architectures"] == ["Phi3VForCausalLM"] and raw["model_type"] == "phi3_v"
    assert raw["hidden_size"] // raw["num_attention_heads"] == 32
    assert raw["img_processor"]["layer_idx"] == 0 and builder.clip_layers(0) == 1
    assert raw["rope_scaling"] is None and raw["torch_dtype"] == "float32"
    cfg = AutoConfig.from_pretrained(tiny_dir, trust_remote_code=True)
    assert type(cfg).__name__ == "Phi3VConfig" and type(cfg).__module__.startswith(
        "transformers_modules"
    )
    assert cfg.vocab_size == 32064 and cfg.rope_parameters["rope_type"] == "default"
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == [
        32000,
        32007,
    ]

    shapes = builder.tiny_weight_shapes(raw)
    with safe_open(str(tiny_dir / builder.WEIGHTS_FILE), "pt") as f:
        assert set(f.keys()) == set(shapes)
        for name in shapes:
            t = f.get_tensor(name)
            assert tuple(t.shape) == shapes[name] and t.dtype == torch.float32, name
        assert torch.all(f.get_tensor("model.norm.weight") == 1)
        emb = f.get_tensor("model.embed_tokens.weight")
        assert 0.015 < emb.std().item() < 0.025
    assert "model.layers.0.self_attn.qkv_proj.weight" in shapes
    assert (
        "model.vision_embed_tokens.img_processor.vision_model.encoder.layers.0.mlp.fc1.weight"
        in shapes
    )
    assert not any(".encoder.layers.1." in n for n in shapes)


def test_seed_changes_weights():
    cfg = builder.model_config("tiny")
    a, b, c = (
        builder.random_weights(cfg, 0),
        builder.random_weights(cfg, 0),
        builder.random_weights(cfg, 1),
    )
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_full_config(full_dir):
    from transformers import AutoConfig

    raw = json.loads((full_dir / "config.json").read_text())
    assert not list(full_dir.glob("*.safetensors"))
    assert (
        raw["hidden_size"],
        raw["intermediate_size"],
        raw["num_hidden_layers"],
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
    ) == (3072, 8192, 32, 32, 32)
    assert raw["img_processor"]["layer_idx"] == -2 and builder.clip_layers(-2) == 23
    assert len(raw["rope_scaling"]["short_factor"]) == len(raw["rope_scaling"]["long_factor"]) == 48
    cfg = AutoConfig.from_pretrained(full_dir, trust_remote_code=True)
    assert cfg.rope_parameters["rope_type"] == "longrope"
    assert cfg.rope_parameters["original_max_position_embeddings"] == 4096
    assert cfg.max_position_embeddings == 131072 and cfg.dtype == torch.bfloat16


def test_full_config_accepted_by_vllm(full_dir):
    """vLLM's own ModelConfig accepts the full-size directory (dummy weights), allocating
    nothing."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=str(full_dir),
        load_format="dummy",
        trust_remote_code=True,
        limit_mm_per_prompt={"image": 2},
        mm_processor_kwargs={"num_crops": 16},
    )
    mc = EngineArgs(max_model_len=131072, **args).create_model_config()
    assert mc.architectures == ["Phi3VForCausalLM"] and mc.is_multimodal_model
    assert mc.get_head_size() == 96 and mc.get_vocab_size() == 32064 and mc.dtype == torch.bfloat16
    assert mc.max_model_len == 131072
    # vLLM quirk: with LongRoPE and no max_model_len, the default is
    # original_max_position_embeddings.
    assert EngineArgs(**args).create_model_config().max_model_len == 4096


# --------------------------------------------------------------------------- builder behaviour


def test_build_is_idempotent_and_force_rebuilds(tmp_path):
    out = tmp_path / "tiny"
    builder.build("tiny", out)
    mtime = (out / builder.WEIGHTS_FILE).stat().st_mtime_ns
    builder.build("tiny", out)
    assert (out / builder.WEIGHTS_FILE).stat().st_mtime_ns == mtime
    builder.build("tiny", out, force=True)
    assert (out / builder.WEIGHTS_FILE).stat().st_mtime_ns != mtime
    builder.build("tiny", out, seed=7)  # different request -> rebuilt
    assert json.loads((out / builder.STAMP_FILE).read_text())["seed"] == 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        builder.build("full", foreign)
    assert (foreign / "keep.txt").exists()


def test_cli(tmp_path):
    out = tmp_path / "full"
    run = subprocess.run(
        [sys.executable, "-m", "serve.models.build", "--size", "full", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 32
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "serve.models.build",
            "--real-from",
            str(tmp_path / "nowhere"),
            "--out",
            str(tmp_path / "real"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "config.json" in run.stderr and "safetensors" in run.stderr


def _fake_download(src: Path) -> dict:
    """A stand-in for the downloaded checkpoint: real-style config, 2 shards + index, tokenizer,
    .py files."""
    src.mkdir()
    real = builder.model_config("full")
    real.update(
        {
            "auto_map": {
                "AutoConfig": "configuration_phi3_v.Phi3VConfig",
                "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM",
            },
            "rope_scaling": {
                "type": "su",
                "short_factor": [1.05] * 48,
                "long_factor": [float(i + 2) for i in range(48)],
            },
            "rope_theta": 10000.0,
            "sliding_window": 131072,
            "eos_token_id": 2,
        }
    )
    real["img_processor"].pop("layer_idx")
    (src / "config.json").write_text(json.dumps(real))
    (src / "model-00001-of-00002.safetensors").write_bytes(b"a")
    (src / "model-00002-of-00002.safetensors").write_bytes(b"b")
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "x": "model-00001-of-00002.safetensors",
                    "y": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    tk.save_tokenizer(src)
    for name in (
        "configuration_phi3_v.py",
        "processing_phi3_v.py",
        "image_processing_phi3_v.py",
        "modeling_phi3_v.py",
    ):
        (src / name).write_text(
            "import torchvision\nraise RuntimeError('Microsoft code must not run')\n"
        )
    return real


def test_prepare_real(tmp_path):
    src = tmp_path / "download"
    real = _fake_download(src)
    out = builder.prepare_real(src, tmp_path / "real")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == real["rope_scaling"]
    assert cfg["auto_map"] == builder.model_config("full")["auto_map"]
    assert "sliding_window" not in cfg and cfg["img_processor"]["layer_idx"] == -2
    for name in builder.REMOTE_CODE_FILES:
        assert not (out / name).is_symlink()
        assert (out / name).read_text() == (builder.REMOTE_CODE_DIR / name).read_text()
    assert (
        not (out / "modeling_phi3_v.py").exists()
        and not (out / "image_processing_phi3_v.py").exists()
    )
    for name in (
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ):
        assert (out / name).is_symlink() and (out / name).resolve() == (src / name).resolve()
        # Relative, so the pair of directories can be mounted elsewhere (deploy/README.md).
        assert not (out / name).readlink().is_absolute()
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert loaded.rope_parameters["rope_type"] == "longrope"
    assert loaded.rope_parameters["long_factor"] == real["rope_scaling"]["long_factor"]
    # Moved together (as mounted in a container), the links still resolve and the start-up
    # check passes; the model directory alone (weights not mounted) is refused by name.
    from serve.__main__ import check_model_dir
    from serve.settings import Settings

    moved = tmp_path / "srv"
    moved.mkdir()
    (src).rename(moved / "download")
    (out).rename(moved / "real")
    assert check_model_dir(Settings(model=str(moved / "real"))) is None
    (moved / "download").rename(tmp_path / "elsewhere")
    problem = check_model_dir(Settings(model=str(moved / "real")))
    assert problem and "model-00001-of-00002.safetensors" in problem and "Mount" in problem
    (tmp_path / "elsewhere").rename(src)
    # weights absent -> a FileNotFoundError naming them
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        builder.prepare_real(src, tmp_path / "real2")


# --------------------------------------------------------------------------- vLLM engine


def _png_data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


ENGINE_IMAGES = {
    "landscape": lambda: Image.open(IMAGES / "chelsea.png").convert("RGB"),
    "portrait": portrait_photo,
    "one_pixel": lambda: Image.open(IMAGES / "one_pixel.png").convert("RGB"),
    "strip": lambda: Image.open(IMAGES / "strip_2000x8.png").convert("RGB"),
    "tall_strip": lambda: (
        Image.open(IMAGES / "strip_2000x8.png").convert("RGB").transpose(Image.Transpose.ROTATE_90)
    ),
}


def _engine_check(model_dir: str) -> dict:
    """Run the real vLLM engine on ``model_dir`` and report prompts and outputs (JSON-able)."""
    import time

    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        model=model_dir,
        trust_remote_code=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        limit_mm_per_prompt={"image": 2},
        mm_processor_kwargs={"num_crops": ENGINE_NUM_CROPS},
        kv_cache_memory_bytes=128 * 2**20,
        seed=0,
    )
    report: dict = {"start_s": time.monotonic() - t0}
    question = "What is in this image?"
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def chat(content, params=greedy, **kw):
        out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False, **kw)[0]
        return {
            "prompt": list(out.prompt_token_ids),
            "output": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
        }

    def image_part(img):
        return {"type": "image_url", "image_url": {"url": _png_data_url(img)}}

    t1 = time.monotonic()
    photo = ENGINE_IMAGES["landscape"]()
    report["photo"] = chat([image_part(photo), {"type": "text", "text": question}]) | {
        "size": photo.size
    }
    report["photo_s"] = time.monotonic() - t1
    report["text_only"] = chat(question)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    report["sizes"] = {}
    for name, make in ENGINE_IMAGES.items():
        img = make()
        report["sizes"][name] = chat([image_part(img), {"type": "text", "text": "?"}], one) | {
            "size": img.size
        }
    imgs = [ENGINE_IMAGES["landscape"](), ENGINE_IMAGES["portrait"]()]
    report["two_images"] = chat(
        [image_part(imgs[0]), image_part(imgs[1]), {"type": "text", "text": "?"}], one
    )
    report["two_images"]["sizes"] = [im.size for im in imgs]
    report["num_crops_1"] = chat(
        [image_part(photo), {"type": "text", "text": "?"}],
        one,
        mm_processor_kwargs={"num_crops": 1},
    )
    report["total_s"] = time.monotonic() - t0
    return report


def _runs(ids: list[int], token_id: int) -> list[int]:
    runs, n = [], 0
    for i in [*ids, None]:
        if i == token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_tiny_model_runs_in_vllm(tiny_dir, hf_tokenizer, tmp_path):
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    result_file = tmp_path / "engine.json"
    run = subprocess.run(
        [sys.executable, __file__, "--engine-check", str(tiny_dir), str(result_file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    for bad in (
        "not initialized",
        "Missing",
        "unexpected",
        "were not used",
        "backward compatibility",
    ):
        assert bad not in log, f"engine log contains {bad!r}"
    report = json.loads(result_file.read_text())
    enc = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ip = proc.Phi3VImageProcessor(num_crops=ENGINE_NUM_CROPS)

    # One real photo through the chat template. vLLM strips the template's BOS for
    # image prompts (documented in serve.models.tokenizer) and re-encodes the chunks
    # around <|image_1|>, whose tokens become N x <|image|> (32044).
    photo = report["photo"]
    n_img = ip.calc_num_image_tokens_from_image_size(*photo["size"])
    assert n_img == 757
    expected = (
        enc("<|user|>\n")
        + [tk.IMAGE_TOKEN_ID] * n_img
        + enc("\nWhat is in this image?<|end|>\n<|assistant|>\n")
    )
    assert photo["prompt"] == expected
    text_only = report["text_only"]["prompt"]
    assert text_only == enc("<s><|user|>\nWhat is in this image?<|end|>\n<|assistant|>\n")
    # prompt tokens = text-only prompt - BOS + "\n" after the placeholder + image tokens
    assert len(photo["prompt"]) == len(text_only) - 1 + 1 + n_img
    assert 1 <= len(photo["output"]) <= 8 and all(0 <= t < tk.VOCAB_SIZE for t in photo["output"])

    # vLLM's placeholder runs (and the model's own embedding count, which must equal them
    # or the engine fails) match our formula for every aspect ratio.
    for name, item in report["sizes"].items():
        want = expected_tokens(*item["size"], ENGINE_NUM_CROPS)
        assert _runs(item["prompt"], tk.IMAGE_TOKEN_ID) == [want], name
        assert len(item["output"]) == 1, name
    assert report["sizes"]["portrait"]["size"] == [214, 640]
    two = report["two_images"]
    assert _runs(two["prompt"], tk.IMAGE_TOKEN_ID) == [
        expected_tokens(*s, ENGINE_NUM_CROPS) for s in two["sizes"]
    ]
    # per-request mm_processor_kwargs override num_crops consistently
    assert _runs(report["num_crops_1"]["prompt"], tk.IMAGE_TOKEN_ID) == [313]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine-check":
        result = _engine_check(sys.argv[2])
        Path(sys.argv[3]).write_text(json.dumps(result))
        print(json.dumps({k: v for k, v in result.items() if k.endswith("_s")}))
    else:
        sys.exit(f"usage: {sys.argv[0]} --engine-check MODEL_DIR RESULT_JSON")
