"""The KV connector's shared folder, made ready before a prefill or decode engine starts.

vLLM's ExampleConnector writes each prompt's KV under this folder while the prefill
engine runs the prompt (a folder per prompt, a safetensors file per layer), and the
decode engine reads it back from there. vLLM does not look at the folder when it
starts: a folder it cannot write shows only at the first prefill, inside the engine's
forward pass (docs/disaggregation.md has what happens then). So the agent makes the
folder when it is missing and writes a file there first; a shard that could not write
fails before launch with the reason, and the reconciler hears it in the shard status.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

# The probe runs on the agent's event loop (validation is synchronous), and a shared
# folder is usually a network mount: a hung one must cost the agent a bounded pause,
# not its heartbeats. The probe's thread is left behind if the mount never answers.
PROBE_SECONDS = 3.0


def unwritable(path: str, timeout: float = PROBE_SECONDS) -> str | None:
    """None when a file can be written in `path` (made first if missing), else why not."""
    answer: list[str | None] = []
    probe = threading.Thread(target=lambda: answer.append(_probe(path)), daemon=True)
    probe.start()
    probe.join(timeout)
    if not answer:
        return f"no answer from the folder within {timeout:g} s (a hung mount?)"
    return answer[0]


def _probe(path: str) -> str | None:
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        return "it is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".llmgw-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
