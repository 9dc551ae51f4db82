# Our own Phi-3-vision configuration class, copied next to config.json by
# `python -m serve.models.build` and loaded by transformers with
# trust_remote_code=True. It must stay self-contained: transformers' dynamic
# module loader only resolves relative imports of sibling files.
"""Phi-3-vision configuration (``model_type = "phi3_v"``).

Field names follow Microsoft's published ``configuration_phi3_v.py`` for
microsoft/Phi-3-vision-128k-instruct (a Llama-style text model plus
``embd_layer`` and ``img_processor`` dicts), so a config.json written for the
real checkpoint loads here unchanged. vLLM's ``Phi3VForCausalLM`` reads the
text fields through its Llama implementation and the two dicts in
``Phi3HDImageEmbedding``:

* ``embd_layer``: ``use_hd_transform`` and ``with_learnable_separator`` must be
  true and ``hd_transform_order`` must be ``"sub_glb"`` (vLLM asserts this);
* ``img_processor``: ``image_dim_out`` 1024, ``num_img_tokens`` 144,
  ``type_feature`` ``"patch"`` and ``layer_idx``, the CLIP ViT-L/14-336 layer
  whose output is used: vLLM builds ``24 + layer_idx + 1`` CLIP layers for a
  negative index, ``layer_idx + 1`` otherwise (``-2`` in the real model).

RoPE: the legacy ``rope_theta`` / ``rope_scaling`` keys of config.json are
folded into ``rope_parameters`` (transformers 5.x); ``"su"`` (the real
checkpoint's name for LongRoPE) is renamed ``"longrope"``.
"""

from transformers import PretrainedConfig

DEFAULT_EMBD_LAYER = {
    "embedding_cls": "image",
    "hd_transform_order": "sub_glb",
    "projection_cls": "mlp",
    "use_hd_transform": True,
    "with_learnable_separator": True,
}
DEFAULT_IMG_PROCESSOR = {
    "image_dim_out": 1024,
    "model_name": "openai/clip-vit-large-patch14-336",
    "name": "clip_vision_model",
    "num_img_tokens": 144,
    "type_feature": "patch",
    "layer_idx": -2,
}


class Phi3VConfig(PretrainedConfig):
    """Configuration of a Phi-3-vision model (text decoder + CLIP image tower).

    Defaults are those of microsoft/Phi-3-vision-128k-instruct (hidden 3072,
    32 layers, 32 heads, vocabulary 32064, 131072 positions). Unknown keys are
    kept as attributes (``PretrainedConfig`` behaviour).
    """

    model_type = "phi3_v"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        hidden_act="silu",
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters=None,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
        sliding_window=None,
        embd_layer=None,
        img_processor=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = (num_attention_heads if num_key_value_heads is None
                                    else num_key_value_heads)
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attention_dropout = attention_dropout
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.sliding_window = sliding_window
        self.embd_layer = dict(DEFAULT_EMBD_LAYER if embd_layer is None else embd_layer)
        self.img_processor = dict(DEFAULT_IMG_PROCESSOR if img_processor is None else img_processor)

        # Legacy RoPE keys (what the real config.json carries) -> rope_parameters.
        rope_scaling = kwargs.pop("rope_scaling", None)
        rope_theta = kwargs.pop("rope_theta", 10000.0)
        params = dict(rope_scaling or rope_parameters or {"rope_type": "default"})
        rope_type = params.pop("type", None)
        params.setdefault("rope_type", rope_type or "default")
        if params["rope_type"] == "su":
            params["rope_type"] = "longrope"
        params.setdefault("rope_theta", rope_theta)
        if params["rope_type"] == "longrope":
            params.setdefault("original_max_position_embeddings", original_max_position_embeddings)
        self.rope_parameters = params
        self.rope_theta = params["rope_theta"]

        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
