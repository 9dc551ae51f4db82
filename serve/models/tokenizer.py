"""A locally built, Phi-3-compatible tokenizer (no model hub needed).

The real Phi-3 tokenizer is a 32000-piece SentencePiece model plus 64 added
tokens (ids 32000..32063). We cannot download it, so this module builds a
stand-in with the `tokenizers` library that keeps everything vLLM relies on:

* exactly :data:`VOCAB_SIZE` = 32064 ids, every one of them decodable;
* Phi-3's special tokens at Phi-3's ids (``<|endoftext|>`` 32000,
  ``<|assistant|>`` 32001, ``<|system|>`` 32006, ``<|end|>`` 32007,
  ``<|user|>`` 32010, and ``<|image|>`` 32044, the id vLLM's ``phi3v.py``
  hard-codes as ``_IMAGE_TOKEN_ID``);
* ``decode(encode(text)) == text`` for any text (byte-level BPE, no
  normalizer, no prefix space, ``clean_up_tokenization_spaces`` off), which
  vLLM's Phi-3-vision path needs because it decodes the prompt ids back to text
  and re-encodes the chunks around each ``<|image_N|>`` placeholder;
* no automatic BOS (no post-processor), and Phi-3's chat template, which
  writes ``<s>`` itself.

Layout of the ids:

====================  ==========================================================
0, 1, 2               ``<unk>``, ``<s>``, ``</s>`` (special)
3 .. 258              the 256 byte symbols of GPT-2's byte-level alphabet, in
                      byte order (id = 3 + byte value)
259 .. 31999          merges generated deterministically (see :func:`_merges`)
32000 .. 32063        Phi-3's added tokens (see :data:`PHI3_ADDED_TOKENS`)
====================  ==========================================================

Known consequence (accepted): since the tokenizer adds no BOS, vLLM's
``Phi3VMultiModalProcessor._apply_prompt_updates`` -- which strips a leading
BOS, decodes, and re-encodes each text chunk with ``tokenizer(chunk)`` -- drops
the chat template's leading ``<s>`` from prompts that carry images. Text-only
prompts keep it. It also strips one space after every special token while
re-encoding image prompts (``text.replace(f"{tok} ", tok)`` in vLLM), which
only matters if a user writes a special-token string followed by a space.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 32064
"""Total number of ids, equal to ``vocab_size`` in the model config."""

BASE_VOCAB_SIZE = 32000
"""Ids of the BPE model proper; the added tokens follow."""

UNK, BOS, EOS_SP = "<unk>", "<s>", "</s>"
ENDOFTEXT, END, USER, ASSISTANT, SYSTEM = (
    "<|endoftext|>",
    "<|end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
)
IMAGE_TOKEN = "<|image|>"
IMAGE_TOKEN_ID = 32044
"""vLLM ``phi3v._IMAGE_TOKEN_ID``: the id that image placeholders expand to."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\n' }}{% endif %}"
)
"""Phi-3's chat template; ``content`` is a plain string (vLLM flattens image
parts into ``<|image_1|>``-style placeholders before rendering)."""

_NAMED_ADDED = {
    32000: ENDOFTEXT,
    32001: ASSISTANT,
    32006: SYSTEM,
    32007: END,
    32010: USER,
    IMAGE_TOKEN_ID: IMAGE_TOKEN,
}


def _added_tokens() -> list[tuple[int, str]]:
    """Phi-3's 64 added tokens as ``(id, content)``, ids 32000..32063.

    The ids that the real Phi-3 tokenizer names are named the same here; every
    other id is ``<|placeholderN|>`` with N counting up from 1 in id order
    (32002..32005 are placeholder1..4, 32008/32009 placeholder5/6, ...).
    """
    out = []
    n = 0
    for token_id in range(BASE_VOCAB_SIZE, VOCAB_SIZE):
        if token_id in _NAMED_ADDED:
            out.append((token_id, _NAMED_ADDED[token_id]))
        else:
            n += 1
            out.append((token_id, f"<|placeholder{n}|>"))
    return out


PHI3_ADDED_TOKENS: list[tuple[int, str]] = _added_tokens()
"""``(id, content)`` for ids 32000..32063, all registered as special tokens."""

EOS_TOKEN_IDS = [32000, 32007]
"""Generation stops on ``<|endoftext|>`` and ``<|end|>`` (Phi-3's generation config)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to
    U+0100 upwards, in byte order. Same algorithm as ``tokenizers``'
    ByteLevel pre-tokenizer, so the symbols built here match its output.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merges(count: int) -> list[tuple[str, str]]:
    """Deterministic BPE merges, ``count`` of them.

    First every ordered pair of printable-ASCII byte symbols (95 x 95 = 9025,
    space included as ``Ġ``), then triples ``(pair, c)`` built on the 676
    lowercase-letter pairs: first with a lowercase third letter, then with the
    other printable characters, until ``count`` merges exist. The ranks carry
    no linguistic meaning; they only make encodings a little shorter.
    """
    b2u = bytes_to_unicode()
    printable = [b2u[b] for b in range(0x20, 0x7F)]
    lower = [b2u[b] for b in range(ord("a"), ord("z") + 1)]
    merges: list[tuple[str, str]] = [(a, b) for a in printable for b in printable]
    lower_pairs = [a + b for a in lower for b in lower]
    others = [c for c in printable if c not in lower]
    for thirds in (lower, others):
        for pair in lower_pairs:
            for c in thirds:
                if len(merges) >= count:
                    return merges
                merges.append((pair, c))
    if len(merges) < count:  # pragma: no cover - guarded by the arithmetic above
        raise AssertionError(f"only {len(merges)} merges available, need {count}")
    return merges[:count]


def build_tokenizer() -> Tokenizer:
    """Build the byte-level BPE tokenizer described in the module docstring.

    Returns a ``tokenizers.Tokenizer`` with exactly :data:`VOCAB_SIZE` ids.
    Deterministic: the same code always yields the same ``tokenizer.json``.

    Raises:
        AssertionError: if an added token does not land on its Phi-3 id.
    """
    b2u = bytes_to_unicode()
    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS_SP: 2}
    for b in range(256):
        vocab[b2u[b]] = 3 + b
    merges = _merges(BASE_VOCAB_SIZE - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == BASE_VOCAB_SIZE, len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None  # no automatic BOS/EOS

    def special(content: str) -> AddedToken:
        return AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                          normalized=False, special=True)

    tok.add_special_tokens([special(UNK), special(BOS), special(EOS_SP)])
    tok.add_special_tokens([special(content) for _, content in PHI3_ADDED_TOKENS])

    for token_id, content in [(0, UNK), (1, BOS), (2, EOS_SP), *PHI3_ADDED_TOKENS]:
        got = tok.token_to_id(content)
        assert got == token_id, f"{content!r} got id {got}, expected {token_id}"
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def tokenizer_config(model_max_length: int = 131072) -> dict:
    """The ``tokenizer_config.json`` contents (transformers 5.x fast tokenizer).

    ``add_bos_token``/``add_eos_token`` are false and there is no
    post-processor, so ``tokenizer(text)`` adds nothing; the chat template
    writes ``<s>`` itself.
    """
    added = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, content in [(0, UNK), (1, BOS), (2, EOS_SP), *PHI3_ADDED_TOKENS]
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": ENDOFTEXT,
        "unk_token": UNK,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    """The ``special_tokens_map.json`` contents (for older loaders)."""
    return {"bos_token": BOS, "eos_token": ENDOFTEXT, "unk_token": UNK, "pad_token": ENDOFTEXT}


def save_tokenizer(out_dir: str | Path, model_max_length: int = 131072) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Args:
        out_dir: existing directory to write into.
        model_max_length: written to ``tokenizer_config.json`` (tokens).

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    build_tokenizer().save(str(paths[0]), pretty=False)
    config = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    paths[1].write_text(config + "\n")
    paths[2].write_text(json.dumps(special_tokens_map(), indent=2) + "\n")
    return paths
