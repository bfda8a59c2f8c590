"""One "rank" for the cluster tests: a long-lived process that loads kernels on command.

Reads one JSON command per line on stdin (``{"cache", "repo", "version", "offline"}``), runs
``kernel_loader.get_kernel`` with that cache in a fresh memo, and answers one JSON line on stdout:
``{"ok": true, "value": <answer()>}`` or ``{"ok": false, "error": "<class>: <message>"}``. Staying
alive between rounds keeps torch's import (seconds of CPU) out of every round.
"""

import json
import os
import sys

import kernel_loader
from kernel_loader import loader
from kernel_loader.machine import detect_machine

detect_machine()  # import torch once, before the first command
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    os.environ["KERNEL_LOADER_CACHE"] = cmd["cache"]
    if cmd.get("offline"):
        os.environ["HF_HUB_OFFLINE"] = "1"
    else:
        os.environ.pop("HF_HUB_OFFLINE", None)
    loader.clear_memo()
    try:
        module = kernel_loader.get_kernel(cmd["repo"], version=cmd.get("version"), trust_remote_code=True)
        out = {"ok": True, "value": module.answer(), "source": module.__kernel_resolution__.source}
    except Exception as exc:  # every outcome is reported to the driver, which judges it
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
