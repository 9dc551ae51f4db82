"""The capacity planner (``serve.plan``) against hand-computed numbers, and its command line."""

from __future__ import annotations

import json
import math

import pytest

from serve import plan
from serve.admission.capacity import Mix, max_image_tokens, tokens_per_request
from serve.models import build
from serve.plan import Deployment, GiB, ModelShape

FULL = ModelShape.from_config(build.model_config("full"))
TINY = ModelShape.from_config(build.model_config("tiny"))


@pytest.fixture
def model_dir(tmp_path):
    """Write a ``config.json`` for a size (or a dict) and return its directory."""
    def write(config: str | dict = "full"):
        config = build.model_config(config) if isinstance(config, str) else config
        (tmp_path / "config.json").write_text(json.dumps(config))
        return str(tmp_path)
    return write


def run(capsys, *argv: str) -> str:
    assert plan.main(list(argv)) == 0
    return capsys.readouterr().out


def table_rows(out: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # without the header


def test_kv_bytes_per_token_is_layers_x_2_x_kv_heads_x_head_dim_x_dtype():
    assert plan.kv_bytes_per_token(FULL) == 32 * 2 * 32 * 96 * 2 == 393_216  # 384 KiB
    assert plan.kv_bytes_per_token(TINY) == 2 * 2 * 4 * 32 * 4 == 2048
    gqa = dict(build.model_config("full"), num_key_value_heads=8, head_dim=128)
    assert plan.kv_bytes_per_token(ModelShape.from_config(gqa)) == 32 * 2 * 8 * 128 * 2
    assert plan.kv_bytes_per_token(ModelShape.from_config(gqa, "float32")) == 32 * 2 * 8 * 128 * 4


def test_parameters_are_the_checkpoint_the_builder_writes():
    for size, shape in (("tiny", TINY), ("full", FULL)):
        shapes = build.tiny_weight_shapes(build.model_config(size))
        assert plan.parameter_count(shape).total == sum(math.prod(s) for s in shapes.values())
    full = plan.parameter_count(FULL)
    assert full.text == 3_821_079_552 and full.total == 4_134_023_168
    assert abs(full.total - 4.15e9) / 4.15e9 < 0.005  # the published 4.15 B (+ 1 CLIP layer)
    assert plan.weight_bytes(FULL) == 2 * 4_134_023_168  # 8.27 GB in bfloat16
    assert (plan.CLIP_WIDTH, plan.CLIP_MLP, plan.CLIP_PATCH, plan.CLIP_IMAGE,
            plan.CLIP_DEPTH) == (build.CLIP_WIDTH, build.CLIP_MLP, build.CLIP_PATCH,
                                 build.CLIP_IMAGE, build.CLIP_FULL_DEPTH)


def test_gpu_defaults_are_the_servers():
    from serve.settings import Settings

    s = Settings(device="cuda").resolved()
    assert plan.GPU_DEFAULTS == {k: getattr(s, k) for k in plan.GPU_DEFAULTS}


def test_activation_peak_by_hand():
    # Images encoded in the profile run: 8192 // 2653 = 3, 17 crops of 577 CLIP tokens each.
    vision = 3 * 17 * 577 * (7 * 1024 + 2 * 4096)
    text = 8192 * (4 * 3072 + 96 * 96 + 3 * 8192)
    sampler = 256 * 32064 * 4 * 2
    assert vision > text
    assert plan.activation_peak_bytes(FULL, 8192, 256, 16) == 2 * vision + sampler == 969_664_512
    # The check in the docstring: Llama-3-8B, vLLM logged 1.26 GiB (PR #10511).
    llama = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       intermediate=14336, vocab=128256, dtype="bfloat16")
    assert abs(plan.activation_peak_bytes(llama, 8192, 256, 1) / GiB - 1.26) < 0.05


def test_an_80_gib_row_by_hand():
    requested = math.ceil(80 * GiB * 0.9)
    overheads = 8_268_046_336 + 969_664_512 + 512 * 2**20 + GiB
    kv = requested - overheads
    assert plan.gpu_kv_cache_bytes(80 * GiB, FULL, Deployment()) == kv == 66_461_087_744
    row = plan.plan_row("80", kv, FULL, Deployment())
    assert row.blocks == kv // (16 * 393_216) == 10_563 and row.kv_tokens == 10_563 * 16
    assert row.max_len_fits and row.longest_fit == 10_562 * 16 >= 131_072
    assert row.concurrency == 169_008 // (2653 + 512) == 53
    eager = plan.gpu_kv_cache_bytes(80 * GiB, FULL, Deployment(enforce_eager=True))
    assert eager - kv == plan.CUDA_GRAPH_BYTES


def test_the_table_has_the_five_gpus_in_order_and_grows_with_memory():
    rows = plan.plan_gpus(FULL, Deployment())
    assert [r.label for r in rows] == ["16 GiB", "24 GiB", "40 GiB", "80 GiB", "141 GiB"]
    for small, big in zip(rows, rows[1:], strict=False):
        assert small.kv_bytes < big.kv_bytes and small.blocks < big.blocks
        assert small.concurrency <= big.concurrency
    # 131,072 tokens of context need 8,193 blocks with the null block: not on 16-40 GiB.
    assert [r.max_len_fits for r in rows] == [False, False, False, True, True]
    assert [r.concurrency for r in rows[:3]] == [0, 0, 0]
    assert all(r.concurrency_at_longest > 0 for r in rows)


def test_image_share_0_and_1():
    assert tokens_per_request(16, Mix(image_share=0)) == 512
    assert tokens_per_request(16, Mix(image_share=1)) == 2653 + 512 == tokens_per_request(16)
    assert tokens_per_request(16, Mix(image_share=0.5)) == math.ceil(2653 / 2) + 512
    assert tokens_per_request(16, Mix(images_per_request=4), max_model_len=4096) == 4096
    text, image = (plan.plan_gpus(FULL, Deployment(mix=Mix(image_share=share)), [141])[0]
                   for share in (0.0, 1.0))
    assert text.blocks == image.blocks  # the mix changes the requests, not the cache
    assert image.concurrency == image.kv_tokens // 3165 == 100
    assert text.concurrency == 256  # kv_tokens // 512 = 622: the max_num_seqs ceiling binds
    with pytest.raises(ValueError, match="image_share"):
        Mix(image_share=-0.1)


def test_kv_cache_bytes_mode_prints_the_table(capsys, model_dir):
    out = run(capsys, "--model", model_dir("tiny"), "--kv-cache-bytes", str(256 * 2**20),
              "--block-size", "128", "--max-model-len", "8192", "--max-num-seqs", "32",
              "--num-crops", "1")
    # The CPU server's own KV cache: 256 MiB / (128 x 2,048 B) = 1,024 blocks, 131,072 tokens.
    assert table_rows(out) == [["kv_cache_bytes 268,435,456", "0.25 GiB", "1,024", "131,072",
                                "yes", "32"]]
    assert "KV per token: 2,048 B" in out and "tokens per image at num_crops 1: 313" in out
    assert f"tokens per request: {max_image_tokens(1) + 512:,}" in out


def test_default_run_prints_the_gpu_table(capsys, model_dir):
    out = run(capsys, "--model", model_dir("full"))
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["16 GiB", "24 GiB", "40 GiB", "80 GiB", "141 GiB"]
    assert rows[3][1:] == ["61.90 GiB", "10,563", "169,008", "yes", "53"]
    assert rows[0][4].startswith("no: vLLM refuses to start") and rows[0][5].startswith("0 (")
    assert "KV per token: 393,216 B (384 KiB)" in out and "parameters: 4,134,023,168" in out


@pytest.mark.parametrize(("argv", "config", "flag"), [
    (["--dtype", "int8"], None, "--dtype"),
    ([], {"torch_dtype": "int8"}, "--dtype"),
    (["--gpu-gib", "0"], None, "--gpu-gib"),
    (["--kv-cache-bytes", "0"], None, "--kv-cache-bytes"),
    (["--gpu-memory-utilization", "0"], None, "--gpu-memory-utilization"),
    (["--image-share", "-0.5"], None, "--image-share"),
    (["--image-share", "1.5"], None, "--image-share"),
    (["--num-crops", "17"], None, "--num-crops"),
    ([], {"num_hidden_layers": 0}, "--model"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, model_dir, argv, config, flag):
    directory = model_dir(dict(build.model_config("full"), **(config or {})))
    with pytest.raises(SystemExit) as stop:
        plan.main(["--model", directory, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert flag in err.splitlines()[-1], err


def test_a_missing_config_names_model(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        plan.main(["--model", str(tmp_path / "nowhere")])
    assert stop.value.code == 2 and "--model: cannot read" in capsys.readouterr().err
