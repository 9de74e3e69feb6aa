"""One of the processes that ``test_multiprocess.py`` starts.

Usage: ``python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in the environment.
Every process builds the same global arrays on a mesh over all processes'
devices, clips them, and checks its own shards against float64 numpy on the
whole tree. Exits 0 when every check passes; prints one ``ok <check>`` line
per check.
"""

import math
import sys


def main(process_id: int, num_processes: int, port: int) -> None:
  import jax

  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id,
                             # no deadline a loaded machine could miss: the
                             # test stops the others if one worker fails
                             initialization_timeout=3600)
  import numpy as np
  from jax import shard_map
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optaxclip as oc

  F = oc.functional
  assert jax.process_count() == num_processes, jax.process_count()
  assert jax.device_count() == 4 * num_processes, jax.devices()
  assert jax.local_device_count() == 4, jax.local_devices()
  axes = ("data", "model")

  # The same values in every process (same seed); each process only holds
  # the shards on its own devices.
  rng = np.random.default_rng(0)
  layout = {"fsdp": ((16, 6), P("data")),
            "tensor_parallel": ((6, 16), P(None, "model")),
            "both": ((8, 12), P("data", "model")),
            "replicated": ((7,), P()),
            "flat": ((24,), P(axes)),
            # equal shape and sharding: reduced as one stack
            "stack": [((8, 8), P(axes)) for _ in range(3)]}
  is_def = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)
  host = jax.tree.map(lambda d: rng.normal(size=d[0]).astype(np.float32), layout,
                      is_leaf=is_def)
  specs = jax.tree.map(lambda d: d[1], layout, is_leaf=is_def)
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(host)]
  want_norm = math.sqrt(sum(float(np.sum(x * x)) for x in leaves))
  max_norm = 1.0
  factor = max_norm / want_norm
  assert factor < 1

  def global_tree(mesh):
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), lambda index, x=x: x[index]),
        host, specs)

  def check_clipped(clipped, tree):
    for x, y, original in zip(jax.tree.leaves(host), jax.tree.leaves(clipped),
                              jax.tree.leaves(tree)):
      assert y.shape == x.shape and y.dtype == x.dtype
      assert y.sharding.is_equivalent_to(original.sharding, x.ndim), (
          y.sharding, original.sharding)
      assert y.addressable_shards, "no local shards"
      for shard in y.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data),
                                   x[shard.index].astype(np.float64) * factor,
                                   rtol=1e-6)

  def check_scalar(value, want, name):
    # Every local copy of a replicated scalar.
    for shard in value.addressable_shards:
      np.testing.assert_allclose(np.asarray(shard.data), want, rtol=1e-6,
                                 err_msg=name)

  for axis_type in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((2, 4), axes, axis_types=(axis_type,) * 2)
    tree = global_tree(mesh)

    # 1. Sharded jit: no user action.
    clipped, norm = jax.jit(lambda t: F.clip_by_global_norm(t, max_norm))(tree)
    check_scalar(norm, want_norm, "norm")
    check_clipped(clipped, tree)
    print(f"ok gspmd {axis_type.name}", flush=True)

  # 2. shard_map with axis_name and specs, transform state per device.
  mesh = jax.make_mesh((2, 4), axes)
  tree = global_tree(mesh)
  tx = oc.clip_by_global_norm(max_norm, axis_name=axes, specs=specs)

  def step(tree):
    updates, state = tx.update(tree, tx.init(tree))
    return updates, state, jax.tree.map(lambda s: s[None], state)

  updates, state, per_device = jax.jit(shard_map(
      step, mesh=mesh, in_specs=(specs,), out_specs=(specs, P(), P(axes))))(tree)
  check_clipped(updates, tree)
  for name, want in (("norm", want_norm), ("scale", factor), ("count", 1),
                     ("clipped_count", 1), ("nonfinite_count", 0)):
    check_scalar(getattr(state, name), want, name)
    check_scalar(getattr(per_device, name), want, name)
  print("ok shard_map", flush=True)

  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*map(int, sys.argv[1:4]))
