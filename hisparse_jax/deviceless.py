"""Compile (not just lower) jitted programs for an NVIDIA H100 / H200 (sm_90) on a machine without a GPU.

XLA's *deviceless* AOT compilation: `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<GpuTargetConfigProto text>)` gives a compile-only CUDA device whose client runs the whole
XLA:GPU pipeline (HLO passes incl. host offloading, Triton for the Pallas kernels, LLVM -> PTX, ptxas ->
cubin) with no driver. Compile errors (shared memory over the limit, host-offload rewrites, ...) raise.
`tests/e2e/test_gpu_build.py` and `experiments/bench_compile.py` use it; `gpu_targets/h100_sxm.txtpb` beside this file
is XLA's public H100 SXM description
(xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb; the H200 has the same compute capability and SM count).

Needs the CUDA PJRT plugin (`jax-cuda13-plugin` / `jax-cuda12-plugin`) and ptxas + libdevice (the
`nvidia-cuda-nvcc` and `nvidia-nvvm` wheels, or a CUDA toolkit); `unavailable_reason()` says what is
missing so tests can skip with that reason.

Two details handled here:
  * Pallas-Triton (jax >= 0.11) reads the compute capability from the *default device*: lowering runs
    under `jax.default_device(<compile-only GPU>)`.
  * A compile-only device has no memories (a memory_kind on its sharding silently becomes None), so
    abstract inputs carry `NamedSharding`s over a 1-CPU mesh with their memory kind (`abstract_on_cpu`);
    we lower for "cuda" and hand the StableHLO to the compile-only client ourselves.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shutil
import sys

import jax
from jax.experimental import topologies

TARGET = pathlib.Path(__file__).resolve().parent / "gpu_targets" / "h100_sxm.txtpb"
# XLA options of every build here (see compile_lowered)
XLA_OPTIONS = {"xla_gpu_autotune_level": "0"}
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _nvidia_dirs() -> list[pathlib.Path]:
    """nvidia/cu13, nvidia/cuda_nvcc, ... in the wheels' site-packages (where XLA looks for ptxas too)."""
    out = []
    for p in sys.path:
        base = pathlib.Path(p or ".") / "nvidia"
        if base.is_dir():
            out.extend(d for d in base.iterdir() if d.is_dir())
    return out


def _toolkit_dirs() -> list[pathlib.Path]:
    dirs = _nvidia_dirs()
    if os.environ.get("CUDA_DIR"):
        dirs.append(pathlib.Path(os.environ["CUDA_DIR"]))
    dirs.append(pathlib.Path("/usr/local/cuda"))
    return dirs


def find_ptxas() -> str | None:
    for d in _toolkit_dirs():
        if (d / "bin" / "ptxas").is_file():
            return str(d / "bin" / "ptxas")
    return shutil.which("ptxas")


def find_libdevice() -> str | None:
    for d in _toolkit_dirs():
        hits = sorted((d / "nvvm" / "libdevice").glob("libdevice*.bc")) if (d / "nvvm").is_dir() else []
        if hits:
            return str(hits[0])
    return None


def cuda_plugin() -> str | None:
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            pass
    return None


def unavailable_reason() -> str | None:
    """Why deviceless GPU compilation cannot run here (None when it can)."""
    missing = []
    if cuda_plugin() is None:
        missing.append("the CUDA PJRT plugin (pip install jax-cuda13-plugin jax-cuda13-pjrt, same version as jax)")
    if find_ptxas() is None:
        missing.append("ptxas (pip install nvidia-cuda-nvcc)")
    if find_libdevice() is None:
        missing.append("libdevice (pip install nvidia-nvvm)")
    if not missing:
        return None
    return f"deviceless sm_90 compilation needs {'; '.join(missing)} (jax {jax.__version__})"


@functools.cache
def gpu_target():
    """The compile-only CUDA device (H100 SXM, sm_90) described by TARGET."""
    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGET.read_text(), topology="1x1x1")
    return topo.devices[0]


def abstract_on_cpu(shape, dtype, memory_kind: str = "device") -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct standing for an array in `memory_kind` ("device" / "pinned_host").

    A NamedSharding over a 1-CPU mesh, not a SingleDeviceSharding: for a ShapeDtypeStruct only a
    NamedSharding carries the memory kind into the abstract value (jax 0.10.2 .. 0.12), and the CPU device
    knows the memory kinds that the compile-only GPU device cannot hold."""
    mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("_",))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind))


def abstractify(tree, memory_kind: str = "device"):
    """Every array / ShapeDtypeStruct leaf of `tree` -> `abstract_on_cpu` with its own memory kind when it
    has a sharding that names one, else `memory_kind`."""
    def one(x):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or memory_kind
        return abstract_on_cpu(x.shape, x.dtype, kind)
    return jax.tree.map(one, tree)


def lower_for_gpu(fn, *args, jit_kwargs=None, **kwargs):
    """Lower `fn` for CUDA. `fn` may already be a `jax.jit` function (its donation etc. are kept as they
    are; then `jit_kwargs` must be None); args may carry CPU-mesh shardings with memory kinds."""
    jitted = fn if (jit_kwargs is None and hasattr(fn, "trace")) else jax.jit(fn, **(jit_kwargs or {}))
    with jax.default_device(gpu_target()):  # Pallas-Triton takes sm_90 from the default device
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def compile_lowered(lowered):
    """XLA:GPU-compile a Lowered (for "cuda") for the compile-only device -> an XLA executable.

    PRIVATE JAX API, isolated here on purpose: `jax._src.compiler.get_compile_options` and
    `jax._src.lib.xla_client.DeviceList` are what jax's own AOT path (`backend_compile_and_load`) uses; the
    public `Lowered.compile()` would compile for the CPU the inputs' shardings name. If a jax upgrade moves
    them, this function is the only place to change.

    XLA's autotuner is off (XLA_OPTIONS: `xla_gpu_autotune_level=0`): a compile-only device has nothing to time
    candidates on. Measured on GLM-5's 4-layer step (jax 0.12.1): the compiled HLO is the same instruction for
    instruction, the Triton GEMM tilings included (only the fusions' emitter annotations, which the autotuner
    leaves unset, are dropped), and the compile takes 17-20 s instead of 27-28 s; test_gpu_build.py's builds
    220 s instead of 350 s."""
    from jax._src import compiler as _compiler
    from jax._src.lib import xla_client as _xc

    dev = gpu_target()
    opts = _compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                         env_options_overrides=dict(XLA_OPTIONS))
    return dev.client.compile(lowered.compiler_ir("stablehlo"), executable_devices=_xc.DeviceList((dev,)),
                              compile_options=opts)


def compile_for_gpu(fn, *args, jit_kwargs=None, **kwargs):
    """`compile_lowered(lower_for_gpu(...))`; raises on any GPU compile error."""
    return compile_lowered(lower_for_gpu(fn, *args, jit_kwargs=jit_kwargs, **kwargs))


def hlo_text(exe) -> str:
    """The optimized (scheduled) HLO module of a compiled executable, as text."""
    return exe.hlo_modules()[0].to_string()


# ----- parsing the compiled HLO ------------------------------------------------------------------
_SHAPE = re.compile(r"^(?P<dt>[a-z0-9_]+)\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[^}]*)\})?$")


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split `s` at `sep` outside (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _balanced(s: str, start: int) -> int:
    """Index one past the bracket closing the one at s[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(s)):
        if s[i] in pairs:
            stack.append(pairs[s[i]])
        elif stack and s[i] == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced text from {start}: {s[start:start + 80]!r}")


def parse_shape(text: str) -> dict:
    """'bf16[4,16,64,512]{3,2,1,0:S(5)}' -> {dtype, dims, memory_space (5 = host, else 0), text}."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()  # drop /*index=5*/ comments
    m = _SHAPE.match(text)
    if not m:
        raise ValueError(f"not an array shape: {text!r}")
    dims = tuple(int(d) for d in m["dims"].split(",") if d)
    layout = m["layout"] or ""
    space = re.search(r"S\((\d+)\)", layout)
    return {"dtype": m["dt"], "dims": dims, "memory_space": int(space.group(1)) if space else 0, "text": text}


def entry_layout(text: str) -> tuple[list[dict], list[dict]]:
    """(parameters, results) of the module's entry_computation_layout, flattened in order."""
    head = text.splitlines()[0]
    i = head.index("entry_computation_layout={") + len("entry_computation_layout=")
    body = head[i + 1:_balanced(head, i) - 1]  # (params)->(results) or (params)->result
    arrow = body.index(")->")
    params = split_top(body[1:arrow])
    res = body[arrow + 3:]
    results = split_top(res[1:-1]) if res.startswith("(") else [res]
    return [parse_shape(p) for p in params], [parse_shape(r) for r in results]


def input_output_aliases(text: str) -> dict[int, tuple[int, str]]:
    """{output index (flat): (parameter number, kind)} from the module's input_output_alias attribute."""
    head = text.splitlines()[0]
    if "input_output_alias={" not in head:
        return {}
    i = head.index("input_output_alias={") + len("input_output_alias=")
    body = head[i:_balanced(head, i)]
    out = {}
    for m in re.finditer(r"\{(\d*)\}:\s*\((\d+),\s*\{[^}]*\},\s*([a-z-]+)\)", body):
        out[int(m.group(1)) if m.group(1) else 0] = (int(m.group(2)), m.group(3))
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<shape>\S+?)\s+(?P<op>[a-z][\w\-]*)\(")


def instructions(text: str):
    """Yield (computation, instruction name, result shape text, opcode, line) for every array-valued
    instruction of every computation (tuple-shaped results are skipped: they are views, not buffers)."""
    comp = None
    for line in text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s) and "=" not in s.split("(")[0]:
            comp = s.split(" ")[1] if s.startswith("ENTRY") else s.split(" ")[0]
            continue
        m = _INSTR.match(line)
        if m and not m["shape"].startswith("("):
            yield comp, m["name"], m["shape"], m["op"], s
