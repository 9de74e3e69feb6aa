"""Programs compiled for an NVIDIA H100 and for TPUs on this CPU-only machine.

JAX runs XLA:GPU's and XLA:TPU's whole optimizing compiler without a device
(deviceless ahead-of-time compilation): ``compiled.as_text()`` is the
program the accelerator would run, after fusion; ``on_cpu`` runs that
program here, to check the numbers of what XLA:GPU and XLA:TPU folded.
This module is the one place that touches the private or unstable APIs
this needs (the topology calls, the generic cost analysis, the text of the
optimized HLO, its conversion for XLA:CPU); when jax
changes, ``test_deviceless.py::test_the_deviceless_helper_still_answers``
says which of them to update here.

Needs ``JAX_PLATFORMS=cpu`` before JAX starts (tests/conftest.py sets it):
otherwise the CUDA plugin fails ``cuInit`` and is never registered. Packages
(compile-only; versions tied to jaxlib's; ``make install-test`` installs
them): ``jax-cuda12-plugin``, ``jax-cuda12-pjrt``, ``nvidia-cuda-nvcc-cu12``
and ``libtpu`` (the version ``jax[tpu]`` pins).
"""

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

INSTALL = ("install them with `make install-test`, or `python tests/deviceless.py > req.txt "
           "&& pip install -r req.txt` (the versions this jaxlib takes)")
UPDATE = ("update tests/deviceless.py for this jax (the topology calls, "
          "jax._src.lib._jax.hlo_module_cost_analysis, the optimized HLO's text, and "
          "on_cpu's xla_client.hlo.hlo_module_from_text, _jax.mlir.hlo_to_stablehlo, "
          "Client.compile_and_load: gpu/DEVICELESS.md has what the first three do)")

# XLA's GPU target config of an H100 SXM (openxla/xla,
# xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb), as the topology call takes it.
H100 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3" """

# Target name -> (platform, topology name, chips per host); one chip each,
# and the 8-chip TPU topology of the shard_map tests.
TARGETS = {"h100": ("cuda", "1x1x1", None), "tpu_v5e": ("tpu", "v5e:1x1", (1, 1, 1)),
           "tpu_v6e": ("tpu", "v6e:1x1", (1, 1, 1)),
           "tpu_v5e_8": ("tpu", "v5e:2x4", (2, 4, 1))}
PACKAGES = {"cuda": ("jax_cuda12_plugin", "nvidia.cuda_nvcc"), "tpu": ("libtpu",)}

# Ops that only move or view an input on its way to the op that reads it: TPU
# prefetch copies (HBM to VMEM), async slices, views, tuple plumbing.
_VIEWS = ("copy-start", "copy-done", "slice-start", "slice-done", "bitcast",
          "get-tuple-element")
_OP = re.compile(r"\s([\w-]+)\(")


def missing(platform: str) -> str | None:
  """Why compiling for `platform` ("cuda", "tpu") cannot work here, or None."""
  absent = [name for name in PACKAGES[platform] if importlib.util.find_spec(name) is None]
  if absent:
    return f"deviceless {platform} compiles need {', '.join(absent)}: {INSTALL}"
  if jax.config.jax_platforms != "cpu":
    return "deviceless compiles need JAX_PLATFORMS=cpu set before JAX starts"
  return None


def require(platform: str) -> None:
  """Skips the test when `platform`'s packages are missing, with how to install
  them; in CI (``CI=true``) fails instead: there they must be installed."""
  import pytest  # here: the benchmark (benchmarks/targets/accelerators.py) runs without it
  reason = missing(platform)
  if reason is None:
    return
  if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    pytest.fail(f"CI=true and {reason}")
  pytest.skip(reason)


@functools.cache
def devices(target: str) -> tuple[Any, ...]:
  """The devices of `target`'s topology (no device needed)."""
  from jax.experimental import topologies
  platform, name, per_host = TARGETS[target]
  require(platform)
  if platform == "cuda":
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100,
                                            topology=name)
  else:
    # libtpu takes a lock file (/tmp/libtpu_lockfile) for the one process that
    # may drive the chips: none here, and pytest-xdist's workers load it each.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            chips_per_host_bounds=per_host)
  return tuple(topology.devices)


def mesh(target: str, axes: tuple[str, ...] = ("x",)) -> jax.sharding.Mesh:
  """A mesh over all of `target`'s devices, on one axis (or `axes`, the
  first taking every device)."""
  found = devices(target)
  shape = (len(found),) + (1,) * (len(axes) - 1)
  return jax.sharding.Mesh(np.array(found).reshape(shape), axes)


def specs(tree: Any, target: str, partition: Any = None) -> Any:
  """Shape/dtype structs of `tree` (arrays, structs or (shape, dtype) pairs)
  on `target`'s first device, as a one-device user's arrays are (no mesh:
  the library picks its single-device layouts); or split as `partition` (a
  tree prefix of PartitionSpecs, as ``shard_map``'s ``in_specs``) says, over
  `mesh(target, axes)` with the axes `partition` names."""
  if partition is None:
    one = jax.sharding.SingleDeviceSharding(devices(target)[0])
    return jax.tree.map(lambda x: _struct(x, one), tree, is_leaf=_is_pair)
  on = mesh(target, _axes(partition))
  return jax.tree.map(
      lambda part, sub: jax.tree.map(lambda x: _struct(x, NamedSharding(on, part)), sub,
                                     is_leaf=_is_pair),
      partition, tree, is_leaf=lambda p: isinstance(p, PartitionSpec))


def _struct(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(*(x if _is_pair(x) else (x.shape, x.dtype)), sharding=sharding)


def _is_pair(x: Any) -> bool:
  """A (shape, dtype) pair (states are tuples too: named ones, of states)."""
  return (type(x) is tuple and len(x) == 2 and type(x[0]) is tuple
          and all(isinstance(n, int) for n in x[0]))


def _axes(partition: Any) -> tuple[str, ...]:
  """The mesh axes `partition` names, in order of first use."""
  names = [a for p in jax.tree.leaves(partition, is_leaf=lambda p: isinstance(p, PartitionSpec))
           for a in p if a is not None]
  return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class Program:
  """What the optimized program does, read from its text and cost analysis.

  Attributes:
    text: the optimized program (``compiled.as_text()``; large constants
      elided).
    module: the optimized ``HloModule`` itself (``on_cpu`` runs it).
    fusions: kernels in the entry computation (``fusion`` instructions).
    conditionals: ``conditional`` instructions anywhere in the module.
    all_reduces: all-reduces anywhere in the module (sync, or async starts).
    readers: per leaf of the watched argument, the instructions that read it
      (through prefetch copies, slices, views and tuple plumbing).
    passes: XLA's generic cost analysis of bytes accessed over the watched
      argument's bytes.
    seconds: the compile's wall time.
  """
  text: str
  module: Any
  fusions: int
  conditionals: int
  all_reduces: int
  readers: tuple[int, ...]
  passes: float
  seconds: float


def compile(fn: Callable[..., Any], args: tuple[Any, ...], watched: int = 0,
            donate: tuple[int, ...] = (), keep_unused: bool = False) -> Program:
  """`jax.jit(fn, donate_argnums=donate, keep_unused=keep_unused)` compiled
  for the devices `args` are placed on (`specs`), read; `watched` is the
  index of the argument whose leaves are counted (the gradients). Traced
  under a one-device mesh of the target when no argument is on a mesh: how
  a trace learns its platform (optaxclip picks its norm kernel by it).
  `on_cpu` needs every argument kept (`keep_unused`) where `fn` leaves
  some unread."""
  start = time.perf_counter()
  with _target_mesh(args), _no_cache_entry():
    compiled = jax.jit(fn, donate_argnums=donate, keep_unused=keep_unused
                       ).lower(*args).compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  entry = _entry(text)
  first = sum(len(jax.tree.leaves(a)) for a in args[:watched])
  count = len(jax.tree.leaves(args[watched]))
  names = _leaf_values(entry, first, first + count)
  readers = tuple(len(_readers(entry, name)) for name in names)
  watched_bytes = sum(x.size * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(args[watched]))
  return Program(text=text, module=compiled.runtime_executable().hlo_modules()[0],
                 fusions=sum(1 for line in entry if _op(line) == "fusion"),
                 conditionals=len(re.findall(r"\sconditional\(", text)),
                 all_reduces=len(re.findall(r"\sall-reduce(?:-start)?\(", text)),
                 readers=readers, passes=bytes_accessed(compiled) / watched_bytes,
                 seconds=seconds)


def _no_cache_entry() -> Any:
  """No entry written to JAX's persistent compilation cache (tests/conftest.py
  sets one): a deviceless executable is written but cannot be read back
  ("PjRtCompiler must be constructed with a Client"), so the same program
  compiled again warned and compiled anyway."""
  from jax._src import config  # private: what to update if it moves
  return config.persistent_cache_min_compile_time_secs(float("inf"))


def _target_mesh(args: tuple[Any, ...]) -> Any:
  """`jax.set_mesh` of the one device the arguments are placed on, or
  nothing where they are on a mesh already."""
  sharding = jax.tree.leaves(args)[0].sharding
  if isinstance(sharding, NamedSharding):
    return contextlib.nullcontext()
  [device] = sharding.device_set
  return jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("device",),
                                        axis_types=(jax.sharding.AxisType.Auto,)))


def bytes_accessed(compiled: Any) -> float:
  """XLA's generic cost analysis of the optimized module (``cost_analysis()``
  is unimplemented for a deviceless GPU compile)."""
  from jax._src.lib import _jax  # private: gpu/DEVICELESS.md
  module = compiled.runtime_executable().hlo_modules()[0]
  return float(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client,
                                             module)["bytes accessed"])


def _entry(text: str) -> list[str]:
  """The instruction lines of the entry computation."""
  body = text[text.index("\nENTRY"):]
  body = body[:body.index("\n}")]
  return [line.strip().removeprefix("ROOT ") for line in body.splitlines() if " = " in line]


def _op(line: str) -> str | None:
  rhs = line.split(" = ", 1)[1]
  match = _OP.search(rhs)
  return match[1] if match else None


def _leaf_values(entry: list[str], first: int, stop: int) -> list[str]:
  """The values that hold flat arguments `first` ... `stop - 1`: parameters,
  or elements of one tuple parameter (XLA:TPU takes many arguments so)."""
  params = {}
  for line in entry:
    match = re.match(r"(%\S+) = (.+?) parameter\((\d+)\)", line)
    if match:
      params[int(match[3])] = (match[2], match[1])
  if len(params) > 1 or not params[0][0].startswith("("):
    return [params[i][1] for i in range(first, stop)]
  tuple_name = params[0][1]
  element = {}
  for line in entry:
    m = re.match(rf"(%\S+) = .*get-tuple-element\({re.escape(tuple_name)}\), index=(\d+)",
                 line)
    if m:
      element[int(m[2])] = m[1]
  return [element[i] for i in range(first, stop)]


def _readers(entry: list[str], name: str) -> set[str]:
  """The instructions that read `name`, following prefetch copies, slices,
  views, tuple plumbing and XLA:TPU's ``ConcatBitcast`` to the real reader."""
  found = set()
  use = re.compile(re.escape(name) + r"(?![\w.-])")
  for line in entry:
    lhs, rhs = line.split(" = ", 1)
    op = _OP.search(rhs)
    if op is None or not use.search(rhs[op.start():]):
      continue
    if op[1] in _VIEWS or "ConcatBitcast" in rhs:
      found |= _readers(entry, lhs)
    elif op[1] != "tuple":
      found.add(lhs)
  return found


# What XLA:CPU cannot take in an accelerator's optimized program, rewritten
# (`on_cpu`): a layout's tiles and memory space (TPU), the scalar layout of
# the entry's signature, a bitcast (a reshape, or between element types),
# a fusion, a prefetch copy's start and end (TPU). (XLA:TPU's async slices
# and ConcatBitcast custom calls, in its step programs, are not yet.)
_TILES = re.compile(r"(\{[\d,]*):[^}]*\}")
_DEFINED = re.compile(r"\s*(?:ROOT )?(%\S+) = (\w+)\[([\d,]*)\](?:\{([\d,]*)\})?")
_BITCAST = re.compile(r"(\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\](?:\{([\d,]*)\})?) "
                      r"bitcast\((%[^)]+)\)")
_FUSION = re.compile(r" fusion\((.*?)\), kind=k\w+, calls=(%[\w.-]+)")
_COPY_START = re.compile(r"\s*(%\S+) = .* copy-start\((%[^)]+)\)")
_COPY_DONE = re.compile(r"(\s*(?:ROOT )?%\S+ = \S+) copy-done\((%[^)]+)\)")


def _row_major(dims: str, layout: str | None) -> bool:
  """Whether a layout (minor to major) lays its array out in C order, up to
  axes of size 1 (which a layout may place anywhere)."""
  if not layout:
    return True
  sizes = [int(d) for d in dims.split(",") if d]
  order = [int(a) for a in layout.split(",") if a and sizes[int(a)] > 1]
  return order == sorted(order, reverse=True)


def _for_the_cpu(text: str) -> str:
  """`text` (an optimized GPU/TPU module) as XLA:CPU parses and runs it:
  the same computation, each fusion a call of its fused computation, each
  bitcast a reshape (or a bitcast-convert between element types). A
  bitcast between arrays not laid out in C order may move entries where a
  reshape does not, and one may change the shape and the element type at
  once: NotImplementedError for both, not a wrong number."""
  element, dims, layouts, starts, lines = {}, {}, {}, {}, []
  for line in text.splitlines():
    line = _TILES.sub(r"\1}", line).replace("[]{}", "[]")
    if (defined := _DEFINED.match(line)):
      element[defined[1]], dims[defined[1]] = defined[2], defined[3]
      layouts[defined[1]] = _row_major(defined[3], defined[4])
    if (start := _COPY_START.match(line)):
      starts[start[1]] = start[2]
      continue
    if (done := _COPY_DONE.match(line)):
      line = f"{done[1]} copy({starts[done[2]]}){line[done.end():]}"
    if (cast := _BITCAST.match(line)):
      source = cast[5]
      if not (_row_major(cast[3], cast[4]) and layouts.get(source, True)):
        raise NotImplementedError(f"a bitcast between layouts, not a reshape: {line.strip()}")
      if element.get(source, cast[2]) == cast[2]:
        op = "reshape"
      elif dims.get(source) == cast[3]:
        op = "bitcast-convert"
      else:
        raise NotImplementedError(f"a bitcast of shape and element type: {line.strip()}")
      line = f"{cast[1]} {op}({source}){line[cast.end():]}"
    lines.append(_FUSION.sub(r" call(\1), to_apply=\2", line))
  return "\n".join(lines)


def on_cpu(program: Program, fn: Callable[..., Any], args: tuple[Any, ...]
           ) -> Callable[..., Any]:
  """`program` (`compile(fn, args)` for an accelerator) compiled for this
  CPU, to run: it takes arrays shaped as `args` and returns `fn`'s result.
  XLA:CPU optimizes the program again, but what XLA:GPU or XLA:TPU folded
  and rewrote stays folded and rewritten; it computes with the CPU's
  arithmetic (subnormals flushed, as on a TPU; a GPU keeps them) and in
  its order: a reduction adds its entries one after the other (a
  variadic one) or in a few vector lanes, where a GPU or a TPU adds
  thousands of short partial sums. A sum of many terms carries more
  rounding here than on the chip (measured: the 3-norm of a 2**18-entry
  leaf, TPU v5e's program, 1.5e-5 relative off; 1024 lanes' partial sums
  of the same terms, exact to float32): checks of numbers keep the
  nonzero entries of a leaf few, or allow for the order."""
  from jax._src.lib import _jax, xla_client  # private: gpu/DEVICELESS.md
  # Whole: `text` elides large constants (`{...}`), which would parse as zeros.
  options = xla_client.hlo.HloPrintOptions()
  options.print_large_constants = True
  text = program.module.to_string(options)
  assert "{...}" not in text, f"a constant of the program is elided: {UPDATE}"
  module = xla_client.hlo.hlo_module_from_text(_for_the_cpu(text))
  stablehlo = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
  cpu = jax.devices("cpu")[:1]
  # (LLVM's optimizations off: XLA:CPU compiles it in 0.45 s, not 0.74; a
  # multiply and an add may then round twice where -O2 contracts them to
  # one FMA, as a GPU's compiler may too: checks allow a few ulps)
  build = xla_client.CompileOptions()
  build.env_option_overrides = [("xla_backend_optimization_level", 0)]
  executable = cpu[0].client.compile_and_load(stablehlo, cpu, build)
  out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
  taken = len(re.findall(r"\sparameter\(\d+\)", "\n".join(_entry(program.text))))
  assert taken == len(jax.tree.leaves(args)), (
      f"the program takes {taken} of the {len(jax.tree.leaves(args))} arguments: "
      f"compile it with keep_unused=True to run it")

  def run(*values):
    flat = [jax.device_put(np.asarray(v), cpu[0]) for v in jax.tree.leaves(values)]
    return jax.tree.unflatten(out_tree, executable.execute(flat))
  return run


def requirements() -> list[str]:
  """What compiling for an H100 and a TPU takes, for the installed jaxlib:
  the CUDA 12 plugin and PJRT at jaxlib's version, ptxas and libdevice
  (``nvidia-cuda-nvcc-cu12``; not ``jax[cuda12]``'s 5 GB of runtime
  libraries), and ``libtpu`` as ``jax[tpu]`` pins it. Linux only (elsewhere
  the tests skip)."""
  version = importlib.metadata.version("jaxlib")
  tpu = [r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or []
         if r.startswith("libtpu") and 'extra == "tpu"' in r]
  linux = '; sys_platform == "linux"'
  return [f"jax-cuda12-plugin=={version}{linux}", f"jax-cuda12-pjrt=={version}{linux}",
          f"nvidia-cuda-nvcc-cu12{linux}", *[f"{r}{linux}" for r in tpu]]


if __name__ == "__main__":  # a requirements file: the Makefile's install-test
  print("\n".join(requirements()))
