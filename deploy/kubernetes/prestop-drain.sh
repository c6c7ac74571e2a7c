#!/bin/sh
# Kubernetes preStop hook for s2s-rt: drain, then wait for the sessions to end.
#
# 1. POST /drain (header S2S-Operator: 1, and the first of S2S_RT_API_KEYS as
#    a Bearer key when keys are set): the process takes no new session (new handshakes get HTTP 503)
#    and /readyz answers 503, so every balancer that checks it (the Service's
#    endpoints, HAProxy) stops sending clients here. Running sessions go on.
# 2. Wait until s2s_sessions_active in /metrics is 0, or S2S_DRAIN_WAIT_S
#    seconds have passed, whichever comes first, then return.
# Kubernetes then sends SIGTERM: s2s-rt gives the responses still running
# S2S_RT_GRACE_PERIOD_S seconds and closes what is left with 1001 (going away).
# So terminationGracePeriodSeconds must be at least
#     S2S_DRAIN_WAIT_S + S2S_RT_GRACE_PERIOD_S + a few seconds.
#
# Environment: S2S_RT_PORT (default 8000), S2S_DRAIN_WAIT_S (default 300).
# Needs only the image's Python (no curl in a slim image). Always exits 0: a
# process that cannot be reached has nothing left to drain.
# The Dockerfile installs this file as /usr/local/bin/s2s-rt-drain.
exec python3 - <<'PY'
import os
import re
import sys
import time
import urllib.request

port = int(os.environ.get("S2S_RT_PORT", "8000"))
wait_s = float(os.environ.get("S2S_DRAIN_WAIT_S", "300"))
base = f"http://127.0.0.1:{port}"


def get(path: str) -> str:
    with urllib.request.urlopen(base + path, timeout=5) as response:
        return response.read().decode()


def drain() -> str:
    headers = {"S2S-Operator": "1"}
    keys = [k for k in os.environ.get("S2S_RT_API_KEYS", "").split(",") if k.strip()]
    if keys:
        headers["Authorization"] = f"Bearer {keys[0].strip()}"
    request = urllib.request.Request(base + "/drain", method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def say(text: str) -> None:
    print(f"s2s-rt preStop: {text}", file=sys.stderr, flush=True)


try:
    say(drain().strip())
except OSError as exc:
    say(f"cannot drain {base}: {exc}; nothing to wait for")
    sys.exit(0)

deadline = time.monotonic() + wait_s
while True:
    try:
        match = re.search(r"^s2s_sessions_active (\d+)", get("/metrics"), re.M)
    except OSError as exc:
        say(f"{base} stopped answering ({exc})")
        break
    active = int(match.group(1)) if match else 0
    if active == 0:
        say("no session left")
        break
    if time.monotonic() >= deadline:
        say(f"{active} sessions still running after {wait_s:g} s; SIGTERM ends them")
        break
    time.sleep(1)
PY
