"""The wheel carries every service package (the package-dir mapping is easy to break)."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["router", "reconciler", "agent", "simengine"]


def test_wheel_builds_and_imports_every_service(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    wheel = next(tmp_path.glob("llmgw-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for svc in SERVICES:
        assert f"llmgw/{svc}/__init__.py" in names
    assert not any(n.startswith(("libs/", "services/")) for n in names)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    # Import from the unpacked wheel only: drop the editable install's finder.
    code = f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {str(target)!r})
import importlib
for name in ["llmgw", "llmgw.contracts", "llmgw.cli"] + ["llmgw." + s for s in {SERVICES!r}]:
    mod = importlib.import_module(name)
    assert mod.__file__.startswith({str(target)!r}), (name, mod.__file__)
print("ok")
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
