"""Admission control and the live ``max_num_seqs`` autotuner.

The autotuner is two pieces: the *controller* (the algorithm) and the *loop* (the periodic
task that samples, asks the controller and applies its answer).

- ``slots``: the counting half of enforcement (the live limit, in-flight requests, the
  completion rate), shared with the simulator;
- ``burst``: admission past the limit of a burst at an idle engine, by its prompt tokens;
- ``limiter``: the asyncio FIFO queue over the slots (queue bounds, SLO shedding);
- ``prefill``: admission by predicted prefill time (the prefill backlog, mode ``auto``);
  ``probe`` measures the engine's prefill costs at boot;
- ``controller``: the pure algorithm (:class:`~serve.admission.signals.Signals` in, new
  limit and a reason out), the only writer of the limit; ``fits`` its arithmetic;
  ``signals`` the data it reads and decides; ``rules`` the names of its switchable rules;
- ``engine_stats``: the engine-side statistics a vLLM stat logger feeds (sliding windows);
- ``loop``: :class:`~serve.admission.loop.AutotuneLoop`, tying them together (plus NVML);
- ``goodput``: the SLO targets and the goodput rule;
- ``middleware``: the ASGI piece in front of vLLM's OpenAI app (429s, goodput accounting);
- ``capacity``: the KV-safe concurrency (pure arithmetic);
- ``service``: :class:`~serve.admission.service.Admission`, the pieces of one API process
  built from :class:`~serve.settings.Settings`.

Our ``phi3v_*`` series are declared in ``serve/metrics.py``. The package imports nothing
itself: every module but ``loop``, ``middleware`` and ``service`` uses only the standard
library (a test checks it), so the algorithm and the simulator
(``bench/sim.py``) load without torch, vLLM or Starlette.
"""
