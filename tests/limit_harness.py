"""Child processes for the refusal tests (test_size_limits.py, test_red_team.py): a script runs named attempts under
an address-space limit and prints, per attempt, its error (type and message), seconds, peak RSS and peak-RSS growth.

`PRELUDE` starts every script (`attempt(name, fn)`, `results`), `CLI` runs `hisparse` command lines given as a JSON
object {name: argv} in argv[1], and `child` runs a script and returns its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

LIMIT = 4 << 30  # RLIMIT_AS of the children: jax needs ~2 GiB of address space to start; a refusal needs no more

PRELUDE = f"""
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
results = {{}}

def peak_kb():
    # this process's own peak RSS (VmHWM): ru_maxrss would start at the parent's RSS, which Linux carries across
    # fork and exec (a child of a large pytest process would report the parent's gigabytes)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

def attempt(name, fn):
    kb, t0 = peak_kb(), time.perf_counter()
    out = {{"error": None, "message": ""}}
    try:
        value = fn()
        if isinstance(value, dict):
            out.update(value)
    except BaseException as e:
        out = {{"error": type(e).__name__, "message": str(e)}}
    out.update(seconds=time.perf_counter() - t0, peak_mb=peak_kb() / 1024, grew_mb=(peak_kb() - kb) / 1024)
    results[name] = out
"""

CLI = PRELUDE + """
import jax
from hisparse_jax import checkpoints
from hisparse_jax.cli import main
from hisparse_jax.hf_config import from_hf_config
from hisparse_jax.train import data

# what every run starts with, outside the measured cases: jax's backend, the text, the default checkpoint's config
jax.devices(), data.load_corpus(), from_hf_config(checkpoints.resolve(checkpoints.DEFAULT))

def cli(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return {"rc": rc, "stderr": err.getvalue()}

for name, argv in json.loads(sys.argv[1]).items():
    attempt(name, lambda: cli(argv))
print(json.dumps(results))
"""


def child_env(devices: int | None = None) -> dict:
    """The environment of a child: CPU jax, with `devices` host devices (None: XLA's default of one)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def child(script: str, *args: str, devices: int | None = None, timeout: float = 240) -> dict:
    """Run `script` (PRELUDE + attempts + `print(json.dumps(results))`) in a child; its results."""
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                       env=child_env(devices))
    assert p.returncode == 0 and p.stdout.strip(), f"child failed ({p.returncode}): {p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def fresh_process(module: str, call: str, timeout: float = 900):
    """`module.call` (a test module under tests/unit or tests/e2e, a call expression returning JSON-able data) run in
    a new Python process, nothing shared with this one (no compiled program, no live array): its decoded result."""
    code = (f"import sys, json; sys.path[:0] = ['tests', 'tests/unit', 'tests/e2e']; import {module}; "
            f"print(json.dumps({module}.{call}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
