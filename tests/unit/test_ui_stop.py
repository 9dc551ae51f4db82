"""Stop closes the answer's HTTP connection at once, in the UI's own interpreter and event loop
(Chainlit's, with ``nest_asyncio`` applied): ``ui_stop_probe.py`` against a streaming peer."""

from __future__ import annotations

import json
import os
import subprocess

from tests.browser.helpers import ensure_ui_venv
from tests.helpers import ROOT

PROBE = ROOT / "tests" / "unit" / "ui_stop_probe.py"


def test_stop_during_a_page_update_closes_the_connection_at_once():
    """Cancelled while it awaits the page (not the network), the answer's task closes its
    connection before it ends: the API sees the client leave and aborts the generation. The
    case ``ApiClient.stream_chat`` runs its exchange in a task of its own for."""
    proc = subprocess.run([ensure_ui_venv(), PROBE, "20"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "CHAINLIT_APP_ROOT": str(ROOT / "ui")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"n": 20, "late": []}, proc.stderr[-3000:]
