"""Benchmarks of the serving stack (not shipped in the wheel).

- ``trace``: seeded, phase-changing workloads (text chat, image-heavy, long outputs, bursts);
- ``sim``: a deterministic discrete-event model of vLLM's continuous-batching engine behind the
  admission gate, driven by the real autotuner (:mod:`serve.admission`);
- ``autotune``: ``python -m bench.autotune``, goodput of the autotuner against static limits.
"""
