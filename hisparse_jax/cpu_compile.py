"""XLA:CPU compile flags for runs made of many small programs: the test suite and the differential fuzzer.

Those runs spend most of their time compiling programs (each batch bucket, prompt length and store format of
a tiny model) that then run for milliseconds, so they ask XLA:CPU to compile fast:

- `-O0` LLVM and none of its expensive passes (no fast-math either way: the same values);
- where the running XLA has them, its elemental (pre-MLIR) fusion emitters and one LLVM module per program. Each
  compile of the MLIR fusion emitters builds and tears down a pool of MLIR contexts, which dominates hundreds of
  small compiles (measured on jax 0.10.2, one tiered `generate` of the tests' tiny model: XLA compile 27.6 s ->
  7.3 s, the same tokens). jax 0.12's XLA no longer has the elemental emitters, and an XLA that does not know a
  flag aborts at start-up, so each of these is first tried in a subprocess.

XLA reads XLA_FLAGS when jax starts its CPU backend: call `request_fast_compile` before that (subprocesses
inherit the environment, and skip the probe). Not for timing anything a user runs: optimised code runs faster.

Such runs also meet a limit of the kernel: every live XLA:CPU executable holds a few memory maps (about 3 for a tiny
program, more for a large one), and a process may hold `vm.max_map_count` (65530 by default). At the limit XLA:CPU
does not fail the compile: it logs "LLVM compilation error: Cannot allocate memory" and segfaults (jax 0.10.2 and
0.12; `docs/xla_cpu_map_limit.md` has the reproducer). `drop_programs_near_map_limit` drops jax's compiled programs
before that happens.
"""

from __future__ import annotations

import os
import subprocess
import sys

FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# known to some XLA versions only: probed before use
PROBED_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def known_xla_flags(candidates, base: str = "") -> list[str]:
    """The flags of `candidates` this interpreter's XLA accepts next to `base` (tried in a subprocess each; one
    subprocess when all are known)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def accepted(flags) -> bool:
        env["XLA_FLAGS"] = " ".join([base, *flags]).strip()
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                               capture_output=True, timeout=300)
        return probe.returncode == 0

    if accepted(candidates):
        return list(candidates)
    return [flag for flag in candidates if accepted([flag])]


def request_fast_compile() -> str:
    """Add the fast-compile flags to XLA_FLAGS unless an optimisation level is already chosen there (a parent
    process's choice, or the user's); returns XLA_FLAGS. Effective only before jax starts its CPU backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = " ".join([flags, *FAST_COMPILE_FLAGS]).strip()
        flags = " ".join([flags, *known_xla_flags(PROBED_FLAGS, flags)])
        os.environ["XLA_FLAGS"] = flags
    return flags


MAP_LIMIT_FILE = "/proc/sys/vm/max_map_count"


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit `vm.max_map_count`), or None where the kernel does not
    say (not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            held = sum(1 for _ in f)
        with open(MAP_LIMIT_FILE) as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def drop_programs_near_map_limit(fraction: float = 0.5) -> bool:
    """When this process holds more than `fraction` of its memory-map limit, drop every program jax compiled
    (`jax.clear_caches()`: later calls compile again) and return True, so that a long run of many compiles does not
    reach the limit, where XLA:CPU segfaults (see the module docstring). Cheap: call it after every unit of work."""
    maps = memory_maps()
    if maps is None or maps[0] <= fraction * maps[1]:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()  # executables still referenced only from cycles
    return True
