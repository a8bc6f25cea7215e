"""Minimal reproducer: XLA:CPU segfaults, instead of failing the compile, when the process is at the kernel's
memory-map limit (`vm.max_map_count`). Needs only jax, on Linux.

    python experiments/repro_xla_cpu_map_limit.py [--spare N]

It fills the process's map table with one-page anonymous mappings (alternating protections, so the kernel
cannot merge neighbours) until `N` maps are left under the limit, then compiles and runs a small jitted
function. With --spare 50 it compiles and runs; with --spare 5 XLA logs "LLVM compilation error: Cannot
allocate memory" and the process dies of SIGSEGV (exit status 139 from a shell, -11 from Python's subprocess),
seen on jax/jaxlib 0.10.2 (Python 3.11) and 0.12.0.1 (Python 3.12). The report is `docs/xla_cpu_map_limit.md`.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import mmap
import sys

PROT_NONE = 0


def maps_held() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def fill_map_table(spare: int) -> int:
    """Map one-page regions until `spare` maps are left under the limit; returns the maps now held."""
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    pages = limit - maps_held() - spare
    if pages <= 0:
        return maps_held()
    size = mmap.PAGESIZE
    base = libc.mmap(None, pages * size, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    for k in range(0, pages, 2):  # every other page PROT_NONE: each page its own map (nothing is touched)
        if libc.mprotect(base + k * size, size, PROT_NONE) != 0:
            break
    return maps_held()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spare", type=int, default=5, help="maps left under vm.max_map_count before the compile")
    a = ap.parse_args(argv)
    faulthandler.enable()  # the fatal signal prints where it happened (inside the backend compile)
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # the CPU client is up before the table is filled
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    held = fill_map_table(a.spare)
    print(f"jax {jax.__version__}: {held} memory maps held, vm.max_map_count {limit}", flush=True)
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 3)
    try:
        value = float(f(jnp.ones((64, 64)))[0])
    except Exception as e:  # noqa: BLE001 - what a fixed XLA would do: fail the compile with an error
        print(f"the compile failed with {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1
    print(f"compiled and ran: {value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
