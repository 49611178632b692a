"""`golden conform` keeps golden's promise: none of its modules import refengine (a subprocess with refengine
made unimportable imports them all, and no file under golden/ has an `import refengine` line), and the
command's client, readers and CLI import without torch or transformers (only the HF scorer needs them).

Run: PYTHONPATH=. python -m pytest tests/golden/test_conform_imports.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    "golden.conform.cli, golden.conform.checks, golden.conform.client, golden.conform.parse, "
    "golden.conform.prom, golden.conform.source, golden.conform.textgate, golden.conform.rowgate, "
    "golden.conform.pytest_plugin, golden.conformance"
)


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_conform_never_imports_refengine(tmp_path):
    code = (
        "import sys; sys.modules['refengine'] = None\n"
        f"import {MODULES}\n"
        "assert not [m for m in sys.modules if m.startswith('refengine') and sys.modules[m] is not None]\n"
        "print('ok')"
    )
    proc = run(code, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "golden").rglob("*.py")
        if any(line.lstrip().startswith(("import refengine", "from refengine")) for line in p.read_text().splitlines())
    ]
    assert not offenders, f"golden files importing refengine: {offenders}"


def test_conform_cli_imports_without_torch(tmp_path):
    code = f"import sys; sys.modules['torch'] = sys.modules['transformers'] = None\nimport {MODULES}\nprint('ok')"
    proc = run(code, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
