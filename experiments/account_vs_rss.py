"""Does the memory account predict what a run takes? `hisparse demo`'s small workload at the largest --hot-rows,
--devices and --requests its memory check accepts, each run's peak RSS against the account
(`demo_checks.workload_costs`, the account `memory.check_account` refuses with), on a CPU where the devices' memory is RAM.

    PYTHONPATH=. python experiments/account_vs_rss.py [--limit-gib 3] [--out experiments/results]

The check's bound is this machine's RAM; a run at the largest accepted value would take all of it, next to
everything else the machine runs. So each child process sees a RAM of `--limit-gib` instead (its
`memory.host_memory_bytes` replaced): the demo refuses a value past it, naming the largest it accepts ("--hot-rows
N must be <= M"), and that M is run. The account leaves out what every run has whatever its sizes (jax's runtime,
compiled programs, the model's activations), so the comparison is of growths: (peak RSS at M - peak RSS at a small
value) against (account at M - account at the small value), for each option; the workload is the same otherwise.
Writes account_vs_rss.json.

Measured (results/account_vs_rss.json, 2 CPU cores shared, 2 GiB): --hot-rows 3,675,004 / --devices 71 /
--requests 566 accepted; peak RSS grew 1.12x / 1.13x / 0.76x the account's growth, and the peak is 1.09x / 1.10x /
0.83x what the check predicts (the small run's peak plus the account's growth). At --requests the host pool is
sized for all requests at once, and its pages take RAM only once written. Before init_store made the host pools
from NumPy zeros (it filled them in device memory and moved them: twice their size meanwhile), --requests grew
1.31x; before the account counted the step's indexer temporaries and XLA:CPU's copy of the store, and before the
mesh made its stacked store in place, devices and requests grew 2.9x and 3.0x the account."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys

from experiments.report import save_json

# the demo's small workload: demo-glm, short prompts, a few new tokens, HiSparse only
WORKLOAD = ["demo", "--preset", "demo-glm", "--requests", "2", "--prompt-len", "128", "--new-tokens", "4",
            "--policies", "hisparse", "--plot", "", "--json"]
# (option, a small value, a value far past any limit)
OPTIONS = [("--hot-rows", "128", "2000000000"), ("--devices", "1", "256"), ("--requests", "2", "1000000000")]

_CHILD = """
import io, contextlib, json, sys
import hisparse_jax.memory as memory
memory.host_memory_bytes = lambda: int(float(sys.argv[1]) * 2 ** 30)  # the RAM the check sees
from hisparse_jax import demo, demo_checks
from hisparse_jax.cli import main
from hisparse_jax.config import get_preset
from hisparse_jax.memory import account_bytes
argv = json.loads(sys.argv[2])
args = demo.parse_args(argv[1:])
cfg = get_preset(args.preset)
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main(argv)  # first: the command sets the CPU's device count before jax starts
costs = demo_checks.workload_costs(args, cfg, args.prompt_len)
totals = account_bytes(costs, ranks=args.devices)
# this process's own peak (VmHWM: ru_maxrss would carry the parent's across fork + exec)
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"rc": rc, "stderr": err.getvalue()[-2000:], "account_bytes": totals["device"] * args.devices
                  + totals["host"], "peak_rss_bytes": hwm}))
"""


def child(argv: list[str], limit_gib: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-c", _CHILD, str(limit_gib), json.dumps(argv)], capture_output=True,
                       text=True, env={**env, "JAX_PLATFORMS": "cpu"}, timeout=3600)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit-gib", type=float, default=3.0, help="the RAM each child's memory check sees (GiB)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--options", default=",".join(o for o, _, _ in OPTIONS))
    a = ap.parse_args()
    rows = []
    for option, small, huge in OPTIONS:
        if option not in a.options.split(","):
            continue
        refused = child(WORKLOAD + [option, huge], a.limit_gib)
        m = re.search(rf"{option} \d+ must be <= (\d+)", refused["stderr"])
        assert refused["rc"] == 2 and m, refused
        largest = m.group(1)
        base, top = child(WORKLOAD + [option, small], a.limit_gib), child(WORKLOAD + [option, largest], a.limit_gib)
        assert base["rc"] == 0 and top["rc"] == 0, (base, top)
        grew, predicted = top["peak_rss_bytes"] - base["peak_rss_bytes"], top["account_bytes"] - base["account_bytes"]
        rows.append({"option": option, "small": int(small), "largest_accepted": int(largest),
                     "account_small": base["account_bytes"], "account_largest": top["account_bytes"],
                     "peak_rss_small": base["peak_rss_bytes"], "peak_rss_largest": top["peak_rss_bytes"],
                     "rss_growth": grew, "account_growth": predicted, "growth_ratio": grew / predicted,
                     # the peak the check predicts: the small run's plus what the account adds
                     "peak_vs_predicted": top["peak_rss_bytes"] / (base["peak_rss_bytes"] + predicted)})
        print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(a.out, "account_vs_rss.json")
    with open(path) if os.path.exists(path) else contextlib.nullcontext() as f:
        old = json.load(f) if f else {}  # earlier runs (and what was found in them) are kept
    code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    run = {"limit_gib": a.limit_gib, "code": code, "rows": rows}
    save_json(path, {**old, "workload": WORKLOAD, "runs": old.get("runs", []) + [run]})


if __name__ == "__main__":
    main()
