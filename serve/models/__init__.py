"""Phi-3-vision model directories for vLLM: builder, tokenizer and our remote code.

``python -m serve.models.build`` writes them; see :mod:`serve.models.build`.
"""
