"""Bit-identity check for refactors of the norm core: every public clipper's
outputs on a battery of inputs, saved once and compared bit for bit.

    python tests/bit_identity.py save /tmp/before.npz    # on the old code
    python tests/bit_identity.py check /tmp/before.npz   # on the new code

Not a test module (the outputs of the old code are not committed): run it
around a change that must not move a number. Covers every public
transform and function over orders, dtypes, magnitudes (subnormal to 1e30,
zeros, NaN/Inf), layer axes, groups, leaf norms, ``eps``, non-finite modes,
gradients, ``vmap``, ``shard_map`` with ``axis_name``/``specs`` and sharded
``jit`` on 8 host devices, and the compiled size (HLO lines, cost-analysis
bytes) of the benchmark's programs.
"""

import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxclip as oc  # noqa: E402

F = oc.functional
ORDERS = (1.0, 2.0, 3.0, 0.5, float("inf"))
SCALES = (0.0, 1e-42, 1e-30, 1e-3, 1.0, 1e3, 1e25, 3e38)


def tree(scale, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"a": (3,), "b": (4, 5), "c": (2, 3, 4), "s": (), "z": (6,)}
  out = {k: jnp.asarray(rng.standard_normal(s) * scale, dtype) for k, s in shapes.items()}
  out["i"] = jnp.arange(3)  # integer: passes through
  return out


def stacked(scale, seed=1):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((4, 4, 8)) * scale, jnp.float32),
          "b": jnp.asarray(rng.standard_normal((4, 8)) * scale, jnp.float32),
          "h": jnp.asarray(rng.standard_normal((8,)) * scale, jnp.float32)}


def bits(x):
  """``x`` as numpy, half floats as their bits (npz has no bfloat16)."""
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype.itemsize == 2 and x.dtype.kind in "fV" else x


def flat(x, prefix, out):
  for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
    out[prefix + jax.tree_util.keystr(path)] = bits(leaf)


def run_tx(tx, grads, out, name, params=None, steps=3):
  state = tx.init(grads if params is None else params)
  update = jax.jit(tx.update)
  for step in range(steps):
    g = jax.tree.map(lambda x, k=step: x * (1 + k)
                     if jnp.issubdtype(x.dtype, jnp.inexact) else x, grads)
    updates, state = update(g, state, params)
    flat(updates, f"{name}/{step}/u", out)
  flat(state, f"{name}/state", out)
  flat(oc.stats(state), f"{name}/stats", out)


def functional(out):
  for s in SCALES:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      t = tree(s, dtype)
      for p in ORDERS:
        out[f"gn/{s}/{dtype.__name__}/{p}"] = bits(F.global_norm(t, p))
        flat(F.clip_by_global_norm(t, 1.0, ord=p), f"cgn/{s}/{dtype.__name__}/{p}", out)
        flat(F.clip_by_norm(t, 1.0, ord=p), f"cn/{s}/{dtype.__name__}/{p}", out)
        flat(F.clip_by_global_norm(t, 1.0, ord=p, eps=1e-6), f"cgne/{s}/{dtype.__name__}/{p}", out)
      flat(F.clip_by_block_rms(t, 0.5), f"rms/{s}/{dtype.__name__}", out)
      flat(F.clip_by_value(t, 0.5), f"val/{s}/{dtype.__name__}", out)
      flat(jax.jit(lambda t: F.clip_by_global_norm(t, 1.0))(t), f"cgnj/{s}/{dtype.__name__}", out)
    st = stacked(s)
    flat(F.clip_by_norm(st, 1.0, layer_axis={"w": 0, "b": 0, "h": None}), f"cnl/{s}", out)
    flat(F.clip_by_block_rms(st, 0.5, layer_axis={"w": 0, "b": 0, "h": None}), f"rmsl/{s}", out)
    params = stacked(1.0, seed=3)
    flat(F.adaptive_grad_clip(st, params, 0.01), f"agc/{s}", out)
    flat(F.adaptive_grad_clip(st, params, 0.01, layer_axis={"w": 0, "b": 0, "h": None}),
         f"agcl/{s}", out)
    flat(F.unitwise_norm(st["w"]), f"unorm/{s}", out)
    ex = {"w": st["w"], "b": st["b"]}
    flat(F.per_example_clip_by_global_norm(ex, 1.0), f"pe/{s}", out)
    flat(F.per_example_clip_by_layer_norm(ex, 1.0), f"pel/{s}", out)
    flat(F.per_example_clip_by_layer_norm({"w": st["w"][None].repeat(2, 0)}, 1.0,
                                          layer_axis=0), f"pell/{s}", out)
    out[f"finite/{s}"] = np.asarray(F.all_finite(tree(s)))
  bad = tree(1.0)
  bad["b"] = bad["b"].at[0, 0].set(jnp.nan)
  for p in ORDERS:
    out[f"gn/nan/{p}"] = np.asarray(F.global_norm(bad, p))
  bad["a"] = bad["a"].at[0].set(jnp.inf)
  out["gn/inf"] = np.asarray(F.global_norm(bad))
  out["finite/bad"] = np.asarray(F.all_finite(bad))
  # gradients and vmap
  for s in (0.0, 1e-30, 1.0, 1e25):
    for p in ORDERS:
      grad = jax.grad(lambda t, p=p: F.global_norm(t, p), allow_int=True)
      flat(grad(tree(s, jnp.float32)), f"grad/{s}/{p}", out)
    batch = jnp.stack([tree(s)["b"], tree(1.0)["b"], tree(1e25)["b"]])
    out[f"vmap/{s}"] = np.asarray(jax.vmap(lambda x: F.clip_by_global_norm([x], 1.0)[1])(batch))
  out["use_norm"] = np.asarray(F.clip_by_global_norm(tree(1.0), 1.0, use_norm=10.0)[0]["b"])


def transforms(out):
  for s in (1e-30, 1.0, 1e25):
    t = tree(s)
    run_tx(oc.clip_by_global_norm(1.0), t, out, f"tx_cgn/{s}")
    run_tx(oc.clip_by_global_norm(1.0, leaf_norms=True), t, out, f"tx_cgnl/{s}")
    run_tx(oc.clip_grad_norm(1.0, 3.0), t, out, f"tx_cgrad/{s}")
    run_tx(oc.clip_by_norm(1.0, ord=1), t, out, f"tx_cn/{s}")
    run_tx(oc.clip_by_block_rms(0.5), t, out, f"tx_rms/{s}")
    run_tx(oc.clip_by_global_norm({"x": 1.0, "y": 2.0},
                                  groups={"a": "x", "b": "y", "c": "x", "s": "y", "z": "x",
                                          "i": "x"}),
           t, out, f"tx_groups/{s}")
    st = stacked(s)
    la = {"w": 0, "b": 0, "h": None}
    run_tx(oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=la), st, out, f"tx_layer/{s}")
    run_tx(oc.clip_by_norm(1.0, layer_axis=la, leaf_norms=True), st, out, f"tx_cnlayer/{s}")
    run_tx(oc.clip_by_block_rms(0.5, layer_axis=la), st, out, f"tx_rmslayer/{s}")
    run_tx(oc.adaptive_grad_clip(0.01), st, out, f"tx_agc/{s}", params=stacked(1.0, 3))
    run_tx(oc.adaptive_grad_clip(0.01, layer_axis=la), st, out, f"tx_agcl/{s}",
           params=stacked(1.0, 3))
    run_tx(oc.adagc(warmup_steps=2, layer_axis=la), st, out, f"tx_adagc/{s}", steps=4)
    run_tx(oc.auto_clip(), t, out, f"tx_auto/{s}")
    run_tx(oc.zclip(warmup_steps=2, leaf_norms=True), t, out, f"tx_zclip/{s}", steps=4)
    run_tx(oc.skip_step(optax.sgd(0.1), zscore=3.0, warmup_steps=2, leaf_norms=True), t, out,
           f"tx_skip/{s}", params=tree(1.0), steps=4)
  for mode in ("propagate", "zero"):
    bad = tree(1.0)
    bad["a"] = bad["a"].at[0].set(jnp.nan)
    run_tx(oc.clip_by_global_norm(1.0, nonfinite=mode), bad, out, f"tx_nf/{mode}")


def distributed(out):
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = {"w": P(None, "data", "model"), "b": P(None, "model"), "h": P()}
  st = stacked(1.0)
  la = {"w": 0, "b": 0, "h": None}

  def sm(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=P(),
                                 check_vma=False))

  out["sm/gn"] = np.asarray(sm(lambda t: F.global_norm(t, axis_name=("data", "model"),
                                                       specs=specs))(st))
  out["sm/gn3"] = np.asarray(sm(lambda t: F.global_norm(t, 3.0, axis_name=("data", "model"),
                                                        specs=specs))(st))
  layer_specs = {"w": P("data", None, "model"), "b": P("data", "model"), "h": P()}
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=la,
                              axis_name=("data", "model"), specs=layer_specs)
  state = tx.init(st)

  def step(t):
    _, s = tx.update(t, state)
    return oc.stats(s)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(layer_specs,), out_specs=P(),
                            check_vma=False))
  flat(f(st), "sm/layer", out)
  sharded = {k: jax.device_put(v, NamedSharding(mesh, s)) for k, v, s in
             zip(st, st.values(), (P(None, "data", "model"), P(None, "model"), P()))}
  flat(jax.jit(lambda t: F.clip_by_global_norm(t, 1.0))(sharded), "gspmd/cgn", out)
  flat(jax.jit(lambda t: F.clip_by_norm(t, 1.0, layer_axis=la))(sharded), "gspmd/cnl", out)
  flat(jax.jit(lambda t: F.adaptive_grad_clip(t, st, 0.01, layer_axis=la))(sharded),
       "gspmd/agc", out)


def instructions(compiled) -> np.ndarray:
  """The HLO instructions of a compiled program (its source-location
  metadata left out: that moves with the Python code, not the program)."""
  return np.asarray(sum(1 for line in compiled.as_text().splitlines()
                        if re.match(r"\s+(ROOT )?%\S+ = ", line)))


def programs(out):
  """HLO instructions and cost-analysis bytes of compiled programs (the
  benchmark's kinds)."""
  rng = np.random.default_rng(0)
  leaves = [jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in [(1000,), (32, 32), (10, 100), (1024,), (8, 128)] * 100]
  for name, tx in {"cgn": oc.clip_by_global_norm(1.0), "cgrad": oc.clip_grad_norm(1.0),
                   "cn": oc.clip_by_norm(1.0)}.items():
    state = tx.init(leaves)
    compiled = jax.jit(tx.update).lower(leaves, state).compile()
    out[f"hlo/{name}"] = instructions(compiled)
    out[f"bytes/{name}"] = np.asarray(compiled.cost_analysis()["bytes accessed"])
    step = optax.chain(tx, optax.adamw(1e-3))
    s2 = step.init(leaves)
    compiled = jax.jit(lambda g, s, p, step=step: step.update(g, s, p)).lower(
        leaves, s2, leaves).compile()
    out[f"hlo/step_{name}"] = instructions(compiled)
    out[f"bytes/step_{name}"] = np.asarray(compiled.cost_analysis()["bytes accessed"])
  st = {"w": jnp.ones((12, 64, 64)), "b": jnp.ones((12, 64))}
  for name, tx in {"layer": oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=0),
                   "agc": oc.adaptive_grad_clip(0.01, layer_axis=0),
                   "rms": oc.clip_by_block_rms(1.0, layer_axis=0),
                   "adagc": oc.adagc(layer_axis=0)}.items():
    state = tx.init(st)
    compiled = jax.jit(tx.update).lower(st, state, st).compile()
    out[f"hlo/{name}"] = instructions(compiled)
    out[f"bytes/{name}"] = np.asarray(compiled.cost_analysis()["bytes accessed"])


def collect():
  out = {}
  functional(out)
  transforms(out)
  distributed(out)
  programs(out)
  return out


def main(mode, path):
  out = collect()
  if mode == "save":
    np.savez(path, **out)
    print(f"saved {len(out)} arrays to {path}")
    return 0
  ref = np.load(path)
  missing = sorted(set(ref.files) - set(out))
  extra = sorted(set(out) - set(ref.files))
  differ = [k for k in ref.files if k in out and not (
      ref[k].shape == out[k].shape and ref[k].dtype == out[k].dtype
      and ref[k].tobytes() == out[k].tobytes())]
  for k in differ:
    print("DIFFERS", k, ref[k].ravel()[:4], out[k].ravel()[:4])
  print(f"{len(ref.files)} arrays: {len(differ)} differ, {len(missing)} missing, "
        f"{len(extra)} new")
  for k in missing[:20]:
    print("MISSING", k)
  return 1 if differ or missing else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], sys.argv[2]))
