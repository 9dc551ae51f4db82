"""Benchmarks of the serving stack (not shipped in the wheel; method in ``bench/README.md``).

- ``compare``: ``make bench``, ours against raw vLLM with a second raw vLLM as the A/A control,
  in interleaved blocks; ``stats`` (paired intervals over blocks) and ``verdict`` (the ledger,
  pooling and the verdict of each target, ``python -m bench.verdict``);
- ``workloads``, ``process``, ``cpu_engine``: the client workloads, server processes and inputs;
- ``layers`` and ``layers_gate``: our request layers against a scripted peer, timed
  (``python -m bench.layers``) and counted in instructions (``make bench-layers``);
- ``trace``: seeded, phase-changing workloads (text chat, image-heavy, long outputs, bursts);
- ``sim``: a deterministic discrete-event model of vLLM's continuous-batching engine behind the
  admission gate, driven by the real autotuner (:mod:`serve.admission`);
- ``autotune``: ``python -m bench.autotune``, goodput of the autotuner against static limits.
"""
