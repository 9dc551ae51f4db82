"""The shape of the code: the pure parts load without anything heavy."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

#: The algorithm and policy modules: the autotuner's controller, the admission limiter, the
#: engine-signal window, the KV-safe capacity, the capacity planner (``python -m serve.plan``),
#: the request rules, the route table, the keys file, the tenant limits and the usage store.
PURE_MODULES = (
    "serve.admission.controller", "serve.admission.limiter", "serve.admission.engine_stats",
    "serve.admission.goodput", "serve.admission.signals", "serve.admission.fits",
    "serve.admission.rules", "serve.admission.slots", "serve.admission.burst",
    "serve.admission.capacity", "serve.plan", "serve.intake.request", "serve.intake.responses",
    "serve.routes", "serve.errors", "serve.keys", "serve.quota", "serve.usage",
)
HEAVY = ("torch", "transformers", "vllm", "starlette", "numpy", "PIL", "prometheus_client",
         "httpx", "pydantic", "fastapi")


def test_pure_modules_import_only_the_standard_library():
    code = ("import sys, json\n"
            f"before = set(sys.modules)\n"
            f"for name in {PURE_MODULES!r}: __import__(name)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    non_stdlib = {m for m in loaded - {"serve"} if m not in sys.stdlib_module_names
                  and not m.startswith("_")}
    assert not non_stdlib, sorted(non_stdlib)


def test_admission_modules_stay_small():
    """One concern per module: none of the admission package's modules passes ~400 lines
    (the controller and the limiter were split into signals, fits, burst, slots)."""
    sizes = {p.name: len(p.read_text().splitlines())
             for p in (ROOT / "serve" / "admission").glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
