"""A gpu_check section's process: its context (`Ctx`: sizes, soft deadline, record), the section files it writes
(DIR/sections/NAME.json, written whole at every update, so a kill leaves the last one) and what the machine and
the device say about themselves (`parent_env`, `device_env`)."""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import subprocess
import time

import jax
import numpy as np

from experiments.gpu_sections.sizes import SIZES


class Ctx:
    """A section's context (in its child process): sizes, a soft deadline, and its JSON file."""

    def __init__(self, args, sizes_name: str, section: str, soft_budget_s: float):
        self.args = args
        self.sizes_name = sizes_name
        self.sz = SIZES[sizes_name]
        self.t0 = time.perf_counter()
        self.budget_s = soft_budget_s
        self.out_dir = args.out
        self.section = section
        self.interpret = jax.default_backend() != "gpu"
        self.record: dict = {}
        self.hlo_texts: list[tuple[str, str]] = []
        # what other sections measured already (the ceilings, for bandwidth ratios)
        self.report: dict = {"sections": read_section_files(args.out)}

    def with_sizes(self, **over) -> "Ctx":
        c = copy.copy(self)
        c.sz = dict(self.sz, **over)
        return c

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, *a):
        print(f"[{self.section} {self.elapsed():6.1f}s]", *a, flush=True)

    @property
    def device(self):
        return jax.devices()[0]

    def sharding(self, kind: str):
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)

    def checkpoint(self, rec: dict) -> None:
        """Called by a kernel check with its correctness record before it is timed (set by `run_variants`)."""

    def partial(self, **kv):
        """Record results so far (status stays "running") and write them out at once."""
        self.record.update(kv)
        self.write()

    def write(self):
        self.record["section_elapsed_s"] = self.elapsed()
        write_json(section_path(self.out_dir, self.section), self.record)
        if self.hlo_texts:
            with open(os.path.join(self.out_dir, f"hlo_{self.section}.txt"), "w") as f:
                for name, text in self.hlo_texts:
                    f.write(f"\n\n===== {name} =====\n{text}")


def section_path(out_dir: str, name: str) -> str:
    """DIR/sections/NAME.json: one section's record."""
    return os.path.join(out_dir, "sections", f"{name}.json")


def write_json(path: str, obj) -> None:
    """`obj` as JSON at `path`, written to a temporary file and renamed (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=jsonable)
    os.replace(path + ".tmp", path)


def read_section_files(out_dir: str) -> dict:
    """Every section record under DIR/sections: name -> record (a file being replaced is skipped)."""
    out = {}
    d = os.path.join(out_dir, "sections")
    for fn in sorted(os.listdir(d)) if os.path.isdir(d) else ():
        if fn.endswith(".json"):
            try:
                with open(os.path.join(d, fn)) as f:
                    out[fn[:-len(".json")]] = json.load(f)
            except (OSError, ValueError):
                pass
    return out


def jsonable(o):
    """NumPy scalars and arrays as JSON values; anything else as its str."""
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def parent_env() -> dict:
    """What the parent can say without touching the accelerator (no jax backend is initialized here)."""
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
           "jax": jax.__version__, "parent_pid": os.getpid(),
           "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                  "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")
                   if os.environ.get(k) is not None}}
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                            "pcie.link.width.current", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
        env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    return env


def device_env(sizes_name: str) -> dict:
    """The device as one child sees it (recorded by every section; the parent keeps the first)."""
    d = jax.devices()[0]
    env = {"backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
           "device_kind": d.device_kind, "sizes": sizes_name, "jax": jax.__version__,
           "memory_kinds": [m.kind for m in d.addressable_memories()], "default_memory_kind": d.default_memory().kind}
    try:
        import flax

        env["flax"] = flax.__version__
    except Exception as e:  # noqa: BLE001
        env["flax"] = f"unavailable: {e}"
    try:
        env["device_memory_bytes_limit"] = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001
        pass
    return env
