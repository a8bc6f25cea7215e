"""Does capacity scale with data-parallel ranks? `hisparse demo` on 1 device and on N devices (a `MeshEngine`,
attention data parallelism) at the same per-device budgets and the same per-device load (`--requests` per
device, so N devices serve N x the requests), side by side in one process: mean running requests per policy,
their ratio N-devices / 1-device (ideal: N), HiSparse / offload at each size (should be preserved), and outputs
identical across policies at each size. Writes JSON.

On a CPU the N devices are fake host devices (the script sets XLA_FLAGS before jax starts), so wall times say
nothing about a GPU; what carries over is running requests, preemptions / swaps, hit rate and bytes moved.

    python experiments/mesh_capacity.py --devices 4 --out experiments/results/mesh_capacity.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from experiments.report import save_json, stamp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per device (default 16)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device-requests", type=float, default=3.5)
    p.add_argument("--out", default="experiments/results/mesh_capacity.json")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={a.devices}").strip()
    import jax

    from hisparse_jax import demo

    common = dict(requests=a.requests, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                  device_requests=a.device_requests, plot="", json=True)
    runs = {}
    for n in (1, a.devices):
        t0 = time.perf_counter()
        print(f"demo on {n} device(s) ...", file=sys.stderr, flush=True)
        runs[n] = demo.run(devices=n, **common)
        runs[n]["wall_s"] = time.perf_counter() - t0
    one, many = runs[1], runs[a.devices]
    policies = list(one["policies"])
    out = {
        "question": "mean running requests on N devices vs 1 at the same per-device budgets and load",
        **stamp(),
        "devices": a.devices, "settings": common, "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(),
        "per_policy": {pol: {
            "mean_running_1": one["policies"][pol]["mean_running"],
            f"mean_running_{a.devices}": many["policies"][pol]["mean_running"],
            "ratio": many["policies"][pol]["mean_running"] / one["policies"][pol]["mean_running"],
            "ranks_mean_running": many["policies"][pol]["ranks_mean_running"],
            "preemptions": [one["policies"][pol]["preemptions"], many["policies"][pol]["preemptions"]],
            "swaps": [one["policies"][pol]["swaps"], many["policies"][pol]["swaps"]],
            "hit_rate": [one["policies"][pol]["hit_rate"], many["policies"][pol]["hit_rate"]],
            "misses": [one["policies"][pol]["misses"], many["policies"][pol]["misses"]],
        } for pol in policies},
        "hisparse_over_offload": [one.get("hisparse_over_offload_mean_running"),
                                  many.get("hisparse_over_offload_mean_running")],
        "outputs_identical_across_policies": [one["outputs_identical"], many["outputs_identical"]],
        "wall_s": [one["wall_s"], many["wall_s"]],
    }
    save_json(a.out, out)
    for pol, r in out["per_policy"].items():
        print(f"{pol:>9}: mean running {r['mean_running_1']:.2f} -> {r[f'mean_running_{a.devices}']:.2f} "
              f"({r['ratio']:.2f}x on {a.devices} devices)")
    print(f"HiSparse / offload: {out['hisparse_over_offload']}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
