"""Admission control and the live ``max_num_seqs`` autotuner.

- ``limiter``: the enforcement (bounded FIFO queue, at most L requests in the engine);
- ``controller``: the pure algorithm (signals in, new L and a reason out);
- ``signals``: engine-side signals from a vLLM stat logger;
- ``autotuner``: the periodic loop tying them together (plus NVML);
- ``middleware``: the ASGI piece in front of vLLM's OpenAI app (429s, goodput accounting);
- ``metrics``: our ``phi3v_*`` Prometheus series;
- ``capacity``: the KV-safe concurrency (pure arithmetic);
- ``service``: :class:`~serve.admission.service.Admission`, the pieces of one API process
  built from :class:`~serve.settings.Settings`.

The package imports nothing itself: ``controller``, ``limiter``, ``signals`` and ``capacity``
use only the standard library (a test checks it), so the autotuner's algorithm and the
simulator (``bench/sim.py``) load without torch, vLLM or Starlette.
"""
