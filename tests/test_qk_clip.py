"""``qk_clip``: Kimi K2's QK-Clip, against numpy references written from the
report's definition (MHA, MLA) and Megatron-LM's (GQA: a group's query heads
and its key head take the factor of the group's largest logit).

Reference (K2 report, section 2.1): for head ``h`` with largest logit
``S_h > tau``, ``gamma_h = tau / S_h``; ``q_C``, ``k_C`` times
``sqrt(gamma_h)``, ``q_R`` times ``gamma_h``, the shared ``k_R`` untouched.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import make_mesh, shard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optaxclip as oc
from optaxclip._attention import heads as heads_module
from optaxclip._attention import layout
from optaxclip._attention.qk_clip import rescaled_update

F = oc.functional
TAU = np.float32(100.0)
RNG = np.random.default_rng(0)


def rand(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def gamma(logits, tau=TAU):
  """The report's gamma per head, in float32 (1 where the head is not clipped)."""
  logits = np.asarray(logits, np.float32)
  return np.where(logits > tau, tau / np.where(logits > tau, logits, 1), 1).astype(np.float32)


def scale(x, factors, axis):
  """``x`` times one factor per index of ``axis``, in float32."""
  shape = [1] * x.ndim
  shape[axis] = -1
  return (x * np.asarray(factors, np.float32).reshape(shape)).astype(np.float32)


def jit_clip(heads, alpha=0.5):
  """``F.qk_clip`` at threshold 100 for one configuration, compiled once per
  module (eager, its many small ops cost seconds)."""
  return jax.jit(functools.partial(F.qk_clip, threshold=100.0, heads=heads, alpha=alpha))


def assert_bits(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# -- MHA, flax layout: kernels [in, heads, head_dim], biases [heads, head_dim].
MHA = {"attn": {"query": {"kernel": rand(6, 4, 3), "bias": rand(4, 3)},
                "key": {"kernel": rand(6, 4, 3), "bias": rand(4, 3)},
                "value": {"kernel": rand(6, 4, 3)}}}
MHA_HEADS = oc.AttentionHeads(query="attn/query", key="attn/key", head_axis=-2)
MHA_LOGITS = np.array([250.0, 99.0, 100.0, 1e4], np.float32)
MHA_CLIP = jit_clip(MHA_HEADS)


def mha_reference(params, logits):
  root = np.sqrt(gamma(logits))
  attn = params["attn"]
  return {"attn": {side: {name: scale(x, root, -2) for name, x in attn[side].items()}
                   for side in ("query", "key")} | {"value": attn["value"]}}


def test_mha_matches_the_report():
  out, g = MHA_CLIP(MHA, MHA_LOGITS)
  jax.tree.map(assert_bits, out, mha_reference(MHA, MHA_LOGITS))
  assert_bits(g, gamma(MHA_LOGITS))  # heads at or below the threshold: 1


def test_gqa_scales_each_group_by_its_largest_logit():
  # 4 query heads, 2 key heads: heads 0, 1 share key 0; heads 2, 3 key 1.
  params = {"q": rand(5, 4, 2), "k": rand(5, 2, 2)}
  logits = np.array([120.0, 400.0, 10.0, 20.0], np.float32)
  out, g = jit_clip(oc.AttentionHeads(query="q", key="k", kv_heads=2))(params, logits)
  group = gamma(logits.reshape(2, 2).max(-1))  # Megatron: clamp(tau / group max, 1)
  assert_bits(out["q"], scale(params["q"], np.sqrt(np.repeat(group, 2)), 1))
  assert_bits(out["k"], scale(params["k"], np.sqrt(group), 1))
  assert_bits(g, np.repeat(group, 2))


def test_mla_fused_leaves_and_the_shared_rotary_key():
  # DeepSeek's layout: wq_b [heads * (nope + rope), rank], wkv_b
  # [heads * (nope + v), kv_rank], wkv_a holds the shared rotary key.
  h, nope, rope, v = 3, 2, 1, 2
  params = {"wq_b": rand(h * (nope + rope), 4), "wkv_b": rand(h * (nope + v), 4),
            "wkv_a": rand(4, 5)}
  logits = np.array([300.0, 50.0, 101.0], np.float32)
  heads = oc.AttentionHeads(query="wq_b", key="wkv_b", head_axis=0, num_heads=h,
                            rotary_dim=rope, key_dim=nope)
  out, _ = jit_clip(heads)(params, logits)
  g = gamma(logits)
  q = params["wq_b"].reshape(h, nope + rope, 4).copy()
  q[:, :nope] = q[:, :nope] * np.sqrt(g)[:, None, None]
  q[:, nope:] = q[:, nope:] * g[:, None, None]
  kv = params["wkv_b"].reshape(h, nope + v, 4).copy()
  kv[:, :nope] = kv[:, :nope] * np.sqrt(g)[:, None, None]
  assert_bits(out["wq_b"], q.reshape(-1, 4))
  assert_bits(out["wkv_b"], kv.reshape(-1, 4))
  assert_bits(out["wkv_a"], params["wkv_a"])  # k_R: untouched


def test_mla_separate_rotary_query_and_stacked_layers():
  # Two stacked layers (layer_axis 0), q_C, q_R and k_C as kernels [L, in, H, d].
  params = {"q_c": rand(2, 4, 3, 2), "q_r": rand(2, 4, 3, 1), "k_c": rand(2, 4, 3, 2)}
  logits = np.array([[300.0, 50.0, 101.0], [1.0, 2e3, 100.0]], np.float32)
  heads = {"mla": oc.AttentionHeads(query="q_c", key="k_c", query_rotary="q_r",
                                    layer_axis=0)}
  out, g = jit_clip(heads)(params, {"mla": logits})
  want = gamma(logits)[:, None, :, None]
  assert_bits(out["q_c"], (params["q_c"] * np.sqrt(want)).astype(np.float32))
  assert_bits(out["k_c"], (params["k_c"] * np.sqrt(want)).astype(np.float32))
  assert_bits(out["q_r"], (params["q_r"] * want).astype(np.float32))
  assert_bits(g["mla"], gamma(logits))


def test_alpha_splits_the_factor_as_megatron():
  params = {"q": rand(3, 2), "k": rand(3, 2)}
  logits = np.array([400.0, 1.0], np.float32)
  heads = oc.AttentionHeads(query="q", key="k", head_axis=-1)
  out, _ = jit_clip(heads, alpha=0.25)(params, logits)
  g = gamma(logits)
  np.testing.assert_allclose(out["q"], params["q"] * g ** 0.25, rtol=1e-6)
  np.testing.assert_allclose(out["k"], params["k"] * g ** 0.75, rtol=1e-6)
  # The logit q.k shrinks by gamma, whatever alpha.
  np.testing.assert_allclose(out["q"][:, 0] @ out["k"][:, 0],
                             params["q"][:, 0] @ params["k"][:, 0] / 4, rtol=1e-5)


def assert_lands(params, updates, want):
  """``params + updates`` is ``want`` bit for bit wherever ``want - params``
  is a float (Sterbenz's lemma covers every weight rescaled within a factor
  2 of where it was); elsewhere within one ulp of ``want - params``."""
  for p, u, t in zip(*(jax.tree.leaves(x) for x in (params, updates, want))):
    p, t = np.asarray(p), np.asarray(t)
    got = p + np.asarray(u)  # optax.apply_updates, in float32
    reachable = t.astype(np.float64) - p == (t - p).astype(np.float64)
    assert_bits(got[reachable], t[reachable])
    assert (np.abs(got.astype(np.float64) - t) <= np.spacing(np.abs(t - p))).all()


# -- The transform: params + updates is the rescaled params + updates.
# Logits a little past the threshold, as in training with QK-Clip on: every
# rescaled weight is within a factor 2 of the old one, so t - p is a float.
TX = optax.chain(optax.sgd(0.01), oc.qk_clip(100.0, heads=MHA_HEADS))
GRADS = jax.tree.map(lambda x: rand(*x.shape), MHA)
SGD = jax.tree.map(lambda g: np.float32(-0.01) * g, GRADS)  # optax.sgd(0.01)'s updates
PLAIN = jax.tree.map(np.add, MHA, SGD)  # optax.apply_updates(MHA, SGD)
NEAR = np.array([130.0, 99.0, 100.0, 110.0], np.float32)
STATE = TX.init(MHA)


@jax.jit
def step(params, state, logits):
  updates, state = TX.update(GRADS, state, params, max_logits=logits)
  return updates, state


def test_applied_updates_are_the_rescaled_weights_bit_for_bit():
  updates, state = step(MHA, STATE, NEAR)
  assert_lands(MHA, updates, MHA_CLIP(PLAIN, NEAR)[0])
  # Heads 1 and 2 (logits 99 and 100) and the values: sgd's updates, bit for bit.
  sgd = SGD
  assert_bits(updates["attn"]["query"]["kernel"][:, 1:3], sgd["attn"]["query"]["kernel"][:, 1:3])
  assert_bits(updates["attn"]["value"]["kernel"], sgd["attn"]["value"]["kernel"])
  stats = oc.stats(state)
  assert {k: int(v) if "logit" not in k else float(v) for k, v in stats.items()} == {
      "qk_clip/max_logit": 130.0, "qk_clip/clipped_heads": 2, "qk_clip/count": 1,
      "qk_clip/clipped_count": 1, "qk_clip/clip_rate": 1}


def test_far_past_the_threshold():
  # Factors 0.1 and 0.63: t - p is a float less often.
  updates, _ = step(MHA, STATE, MHA_LOGITS)
  assert_lands(MHA, updates, MHA_CLIP(PLAIN, MHA_LOGITS)[0])


def test_nonfinite_logits_leave_their_heads_alone():
  logits = np.array([np.nan, np.inf, 150.0, 1.0], np.float32)
  updates, state = step(MHA, STATE, logits)
  sgd = SGD
  assert_bits(updates["attn"]["key"]["kernel"][:, :2], sgd["attn"]["key"]["kernel"][:, :2])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(updates))
  assert int(state[1].clipped_heads) == 1 and np.isnan(state[1].max_logit)


CLIP_ALONE = oc.qk_clip(100.0, heads=MHA_HEADS)


@jax.jit
def clip_alone(updates, params, logits):
  return CLIP_ALONE.update(updates, CLIP_ALONE.init(params), params, max_logits=logits)[0]


def test_bfloat16_params_match_a_rescale_by_hand():
  params = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), MHA)
  updates = clip_alone(GRADS, params, MHA_LOGITS)

  def apply(p, u):  # optax.apply_updates: added in float32, rounded to bfloat16
    return (p.astype(np.float32) + np.asarray(u)).astype(ml_dtypes.bfloat16)

  kernel, grad = params["attn"]["key"]["kernel"], GRADS["attn"]["key"]["kernel"]
  # By hand: the applied kernel rescaled in float32, rounded to bfloat16.
  root = np.sqrt(gamma(MHA_LOGITS))
  want = (apply(kernel, grad).astype(np.float32) * root[:, None]).astype(ml_dtypes.bfloat16)
  assert_bits(apply(kernel, updates["attn"]["key"]["kernel"]), want)


def test_multisteps_rescales_once_per_optimizer_step():
  # optax.identity: no multiply that XLA could fuse with the add into an FMA.
  tx = optax.MultiSteps(optax.chain(optax.identity(), oc.qk_clip(100.0, heads=MHA_HEADS)),
                        every_k_schedule=2)
  state, params = tx.init(MHA), MHA
  update = jax.jit(tx.update)
  updates, state = update(GRADS, state, params, max_logits=MHA_LOGITS)  # ignored
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0), updates)  # micro-step
  updates, state = update(GRADS, state, params, max_logits=NEAR)  # the window's max
  plain = jax.tree.map(np.add, MHA, GRADS)
  assert_lands(params, updates, MHA_CLIP(plain, NEAR)[0])
  assert int(oc.stats(state)["qk_clip/count"]) == 1


def test_sharded_over_heads_equals_unsharded():
  params = {"q": rand(4, 8, 2), "k": rand(4, 8, 2)}
  grads = jax.tree.map(lambda x: rand(*x.shape), params)
  logits = np.linspace(50.0, 400.0, 8).astype(np.float32)
  tx = optax.chain(optax.sgd(0.1), oc.qk_clip(100.0, heads=oc.AttentionHeads("q", "k")))
  run = jax.jit(lambda p, g, m: tx.update(g, tx.init(p), p, max_logits=m)[0])
  mesh = make_mesh((8,), ("h",))
  specs = {"q": P(None, "h"), "k": P(None, "h")}
  sharded = run(shard(params, mesh, specs), shard(grads, mesh, specs),
                shard(logits, mesh, P("h")))
  plain = jax.tree.map(lambda p, g: p + np.float32(-0.1) * g, params, grads)
  want = {name: scale(x, np.sqrt(gamma(logits)), 1) for name, x in plain.items()}
  assert_lands(params, sharded, want)
  assert_lands(params, run(params, grads, logits), want)


# -- Exactness of one entry: p + u' lands on t = f * (p + u).
BIG = float(np.float32(2e38))
FLOATS = st.floats(-BIG, BIG, allow_nan=False, allow_infinity=False, width=32)


@jax.jit
def entries(p, u, f):
  return rescaled_update(p, u, f)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(FLOATS, FLOATS, st.floats(float(np.float32(1e-6)), 1.0, width=32)),
                min_size=64, max_size=64))
def test_rescaled_update_lands_on_the_target(rows):
  p, u, f = (np.array(c, np.float32) for c in zip(*rows))
  with np.errstate(all="ignore"):
    w = p + u
    t = (w * f).astype(np.float32)
    out = np.asarray(entries(p, u, f))
    landed = p + out
    # XLA flushes subnormals to zero (CPU and GPU): such entries are out.
    normal = [(x == 0) | (np.abs(x) >= np.finfo(np.float32).tiny) for x in (p, u, w, t, t - p)]
    finite = np.isfinite(w) & np.isfinite(t - p) & np.logical_and.reduce(normal)
    # Exact whenever t - p is a float (Sterbenz: p/2 <= t <= 2p, among others),
    representable = (t.astype(np.float64) - p) == (t - p).astype(np.float64)
    ok = landed == t
    assert ok[finite & representable].all()
    # otherwise within one ulp of t - p (twice t - p's rounding at most),
    miss = np.abs(landed.astype(np.float64) - t)
    assert (miss <= np.spacing(np.abs(t - p)))[finite].all()
    # and no neighbour of the update lands either.
    for step in (-np.inf, np.inf):
      near = np.nextafter(out, np.float32(step))
      assert not ((p + near == t) & ~ok & finite).any()
  unclipped = f == 1
  np.testing.assert_array_equal(out[unclipped].view(np.int32), u[unclipped].view(np.int32))


def test_small_factors_and_steps_are_exact_in_practice():
  # Realistic weights (|p| ~ 1e-2), steps 1e-3 of them, factors down to 1e-3.
  p = (RNG.standard_normal(100_000) * 1e-2).astype(np.float32)
  u = (p * RNG.standard_normal(100_000) * 1e-3).astype(np.float32)
  f = np.geomspace(1e-3, 1, 100_000).astype(np.float32)
  out = np.asarray(entries(p, u, f))
  t = ((p + u) * f).astype(np.float32)
  exact = np.mean(p + out == t)
  assert exact == 1.0 or (f[p + out != t] < 0.5).all(), exact


# -- Bad input: clear errors at build, init or the first update.
@pytest.mark.parametrize("call,error,pattern", [
    (lambda: oc.qk_clip(0.0, heads=MHA_HEADS), ValueError,
     r"`qk_clip\(threshold=\.\.\.\)` must be a finite number > 0, got 0.0"),
    (lambda: oc.qk_clip(float("nan"), heads=MHA_HEADS), ValueError, r"threshold.*got nan"),
    (lambda: oc.qk_clip(100.0, heads=MHA_HEADS, alpha=1.0), ValueError,
     r"`qk_clip\(alpha=\.\.\.\)` must be a number in \(0, 1\)"),
    (lambda: oc.qk_clip(100.0, heads=["attn/query"]), TypeError,
     r"`qk_clip\(heads=\.\.\.\)` must be an AttentionHeads or a non-empty dict"),
    (lambda: oc.qk_clip(100.0, heads={"a": "attn/query"}), TypeError,
     r"`qk_clip\(heads=\.\.\.\)`: heads\['a'\] must be an AttentionHeads, got 'attn/query'"),
    (lambda: oc.qk_clip(100.0, heads=MHA_HEADS._replace(head_axis=3)).init(MHA), ValueError,
     r"AttentionHeads.head_axis=3, but leaf 'attn/query/bias' has 2 axes"),
    (lambda: oc.qk_clip(100.0, heads=MHA_HEADS._replace(key="attn/kee")).init(MHA),
     ValueError, r"key='attn/kee' selects no leaf of the parameters"),
    (lambda: oc.qk_clip(100.0, heads=MHA_HEADS._replace(key="attn/query")).init(MHA),
     ValueError, r"leaf 'attn/query/bias' is selected twice \(AttentionHeads.query and "
     r"AttentionHeads.key\)"),
    (lambda: MHA_CLIP(MHA, MHA_LOGITS[:3]), ValueError,  # raised while tracing
     r"AttentionHeads leaf 'attn/query/bias' has 4 entries along its head axis \(0\), "
     r"but max_logits has 3 heads"),
    (lambda: MHA_CLIP(MHA, MHA_LOGITS[None]), ValueError,
     r"`update\(max_logits=\.\.\.\)` for AttentionHeads must be real numbers of "
     r"shape \[heads\], got shape \(1, 4\)"),
    (lambda: TX.update(GRADS, TX.init(MHA), MHA), TypeError,
     r"`qk_clip`: update needs the step's largest attention logit of every head"),
    (lambda: TX.update(GRADS, TX.init(MHA), None, max_logits=MHA_LOGITS), ValueError,
     r"`qk_clip`: .*params"),
    (lambda: F.qk_clip(MHA, {"b": MHA_LOGITS}, heads={"a": MHA_HEADS}), ValueError,
     r"`update\(max_logits=\.\.\.\)` must be a dict with the keys of `heads` \(\['a'\]\)"),
])
def test_bad_input_is_a_clear_error(call, error, pattern):
  with pytest.raises(error, match=pattern):
    call()


# -- Every field of AttentionHeads is checked when the transform is built,
# for a lone block and a dict of blocks alike (issue 32).
BAD_FIELDS = [
    (dict(head_axis=1.5), TypeError, r"head_axis must be an int \(the axis .*got 1.5"),
    (dict(head_axis="-2"), TypeError, r"head_axis must be an int .*got '-2'"),
    (dict(head_axis=None), TypeError, r"head_axis must be an int .*got None"),
    (dict(head_axis=True), TypeError, r"head_axis must be an int .*got True"),
    (dict(layer_axis="0"), TypeError, r"layer_axis must be an int or None .*got '0'"),
    (dict(kv_heads="2"), TypeError, r"kv_heads must be an int >= 1 or None .*got '2'"),
    (dict(kv_heads=2.0), TypeError, r"kv_heads must be an int >= 1 or None .*got 2.0"),
    (dict(kv_heads=-1), ValueError, r"kv_heads must be an int >= 1 or None .*got -1"),
    (dict(kv_heads=0), ValueError, r"kv_heads must be an int >= 1 or None .*got 0"),
    (dict(num_heads=0), ValueError, r"num_heads must be an int >= 1 or None .*got 0"),
    (dict(num_heads="4"), TypeError, r"num_heads must be an int >= 1 or None .*got '4'"),
    (dict(num_heads=4, kv_heads=3), ValueError,
     r": num_heads=4 must be a multiple of kv_heads=3"),
    (dict(key_dim="1"), TypeError, r"key_dim must be an int >= 1 or None .*got '1'"),
    (dict(key_dim=0), ValueError, r"key_dim must be an int >= 1 or None .*got 0"),
    (dict(rotary_dim=-1), ValueError, r"rotary_dim must be an int >= 0 \(.*got -1"),
    (dict(rotary_dim=None), TypeError, r"rotary_dim must be an int >= 0 \(.*got None"),
    (dict(qkv_axis="0"), TypeError, r"qkv_axis must be an int or None .*got '0'"),
    (dict(query=5), TypeError, r"query must be a leaf path such as .*got 5"),
    (dict(key=[["k"]]), TypeError, r"key must be a leaf path .*got \[\['k'\]\]"),
    (dict(query=()), ValueError, r" declares no query leaves: give query= and key="),
    (dict(qkv="attn/value"), ValueError,
     r"qkv_layout must be 'megatron' \(per key head: .*got None"),
    (dict(qkv_layout="megatron"), ValueError,
     r"qkv_layout='megatron' describes qkv leaves, but qkv selects none"),
    (dict(qkv="attn/value", qkv_layout="megatron", qkv_axis=-3), ValueError,
     r"qkv_axis=-3 separates query, key and value .* qkv_layout='concat'"),
    (dict(qkv="attn/value", qkv_layout="concat", qkv_axis=-3, num_heads=4, kv_heads=2),
     ValueError, r"holds as many key heads as query heads, got kv_heads=2"),
    (dict(qkv="attn/value", qkv_layout="megatron", rotary_dim=1), ValueError,
     r"qkv leaves hold no rotary or latent parts"),
]


@pytest.mark.parametrize("form", ["lone", "dict"])
@pytest.mark.parametrize("fields,error,pattern", BAD_FIELDS,
                         ids=[str(row[0]) for row in BAD_FIELDS])
def test_every_bad_field_is_refused_in_both_forms(form, fields, error, pattern):
  block = MHA_HEADS._replace(**fields)
  heads, where = ((block, r"AttentionHeads") if form == "lone"
                  else ({"a": MHA_HEADS, "b": block}, r"heads\['b'\]"))
  for build in (lambda: oc.qk_clip(100.0, heads=heads),
                lambda: F.qk_clip(MHA, MHA_LOGITS, heads=heads)):
    with pytest.raises(error, match=r"`qk_clip\(heads=\.\.\.\)`: " + where + ".*"
                       + pattern.lstrip(": ")):
      build()


def test_a_dict_of_logits_for_a_lone_block_says_what_to_pass():
  with pytest.raises(TypeError, match=r"`update\(max_logits=\.\.\.\)` must be one array "
                     r"\[heads\] when `heads` is one AttentionHeads, got a dict with keys "
                     r"\['attn'\]; pass the array, or name the block"):
    F.qk_clip(MHA, {"attn": MHA_LOGITS}, heads=MHA_HEADS)


# -- The number of heads: declared (num_heads), or one entry per head.
def test_fewer_logits_than_heads_is_an_error_not_a_rescale_in_pairs():
  # A 4-head flax kernel and 2 logits: was factors [0.5, 0.5, 1, 1], silently.
  with pytest.raises(ValueError, match=r"leaf 'attn/query/bias' has 4 entries along its "
                     r"head axis \(0\), but max_logits has 2 heads \(2 query heads\)\. .*"
                     r"AttentionHeads\(\.\.\., num_heads=2\)"):
    F.qk_clip(MHA, np.array([400.0, 1.0], np.float32), heads=MHA_HEADS)
  declared = oc.qk_clip(100.0, heads=MHA_HEADS._replace(num_heads=4))
  with pytest.raises(ValueError, match=r"`update\(max_logits=\.\.\.\)` for AttentionHeads "
                     r"must be real numbers of shape \[heads\] with heads=4 \(num_heads\), "
                     r"got shape \(2,\)"):
    declared.update(GRADS, declared.init(MHA), MHA, max_logits=np.ones(2, np.float32))


def test_declared_heads_check_every_leaf_at_init():
  # head_dim 3 per head of a fused [heads * head_dim, in] weight: 12 rows, 4 heads.
  params = {"q": rand(12, 5), "k": rand(10, 5)}
  tx = oc.qk_clip(heads={"b": oc.AttentionHeads("q", "k", head_axis=0, num_heads=4)})
  with pytest.raises(ValueError, match=r"heads\['b'\] leaf 'k' has 10 entries along its "
                     r"head axis \(0\), not a multiple of its 4 key heads"):
    tx.init(params)


# -- optax.inject_hyperparams: alpha (injected, 0.5 by default) is traced.
INJECTED = optax.inject_hyperparams(oc.qk_clip)(threshold=100.0, heads=MHA_HEADS)


@jax.jit
def injected_step(state, alpha):
  state.hyperparams["alpha"] = alpha
  return INJECTED.update(GRADS, state, MHA, max_logits=MHA_LOGITS)[0]


@pytest.mark.parametrize("alpha", [0.5, 0.25, 2.0, np.nan])
def test_injected_alpha_is_traced_under_jit(alpha):
  updates = injected_step(INJECTED.init(MHA), np.float32(alpha))
  clipped = 0.0 if np.isnan(alpha) else min(alpha, 1.0)  # clamped to [0, 1], NaN to 0
  if alpha == 0.5:  # the default: the plain transform's update, bit for bit
    jax.tree.map(assert_bits, updates, clip_alone(GRADS, MHA, MHA_LOGITS))
  want, got = (jax.tree.map(np.add, MHA, u) for u in (GRADS, updates))
  g = gamma(MHA_LOGITS)
  for side, power in (("query", clipped), ("key", 1 - clipped)):
    np.testing.assert_allclose(got["attn"][side]["kernel"],
                               scale(want["attn"][side]["kernel"], g ** power, 1),
                               rtol=1e-5, atol=1e-6)


def test_a_concrete_bad_alpha_is_refused_at_init():
  tx = optax.inject_hyperparams(oc.qk_clip)(threshold=100.0, heads=MHA_HEADS, alpha=1.5)
  with pytest.raises(ValueError, match=r"`qk_clip\(alpha=\.\.\.\)` must be a number in"):
    tx.init(MHA)


# -- Fused QKV leaves, against references written from Megatron-LM's code:
# `SelfAttention.get_query_key_value_tensors` views `linear_qkv`'s output as
# [ng, (np/ng + 2) * hn]: per key-value group its np/ng query heads, its key
# head, its value head; `clip_qk` takes each group's largest logit,
# eta = clamp(tau / max, max=1), and multiplies the group's query rows by
# eta ** alpha and its key rows by eta ** (1 - alpha) (values untouched).
@functools.cache
def clip_for(heads, alpha=0.5):
  """``jit_clip``, compiled once per configuration for the whole module."""
  return jit_clip(heads, alpha)


def megatron_fuse(q, k, v, kv):
  """Megatron's fused rows (axis 1) from separate weights ``[layers, rows,
  in]`` or biases ``[layers, rows]``: per group its query, key, value rows."""
  groups = [np.moveaxis(x, 1, -1).reshape(*x.shape[:1], *x.shape[2:], kv, -1)
            for x in (q, k, v)]
  fused = np.concatenate(groups, axis=-1)
  return np.moveaxis(fused.reshape(*fused.shape[:-2], -1), -1, 1)


def megatron_clip_qk(weight, logits, heads, kv, alpha, tau=TAU):
  """Megatron-LM's ``clip_qk`` on one layer's ``linear_qkv`` rows, in
  float32 (``sqrt`` for alpha = 1/2, the report's factor)."""
  eta = gamma(logits.reshape(kv, heads // kv).max(-1), tau)  # clamp(tau / max, max=1)
  up = np.sqrt(eta) if alpha == 0.5 else eta ** np.float32(alpha)
  down = np.sqrt(eta) if alpha == 0.5 else eta ** np.float32(1 - alpha)
  rows = weight.reshape(kv, heads // kv + 2, -1, *weight.shape[1:]).copy()
  rows[:, :-2] *= up.reshape(kv, 1, 1, *[1] * (weight.ndim - 1))
  rows[:, -2] *= down.reshape(kv, 1, *[1] * (weight.ndim - 1))
  return rows.reshape(weight.shape)


LAYERS, NP, NG, HN, IN = 2, 4, 2, 3, 5  # layers, heads, groups, head size, hidden
SEPARATE = {name: {"weight": rand(LAYERS, n * HN, IN), "bias": rand(LAYERS, n * HN)}
            for name, n in (("q", NP), ("k", NG), ("v", NG))}
FUSED = {"linear_qkv": {part: megatron_fuse(SEPARATE["q"][part], SEPARATE["k"][part],
                                             SEPARATE["v"][part], NG)
                        for part in ("weight", "bias")}}
QKV_LOGITS = np.array([[120.0, 400.0, 10.0, 20.0], [99.0, 100.0, 3e3, 101.0]], np.float32)
SEPARATE_HEADS = oc.AttentionHeads(query="q", key="k", head_axis=1, layer_axis=0,
                                   num_heads=NP, kv_heads=NG)
FUSED_HEADS = oc.AttentionHeads(qkv="linear_qkv", qkv_layout="megatron", head_axis=1,
                                layer_axis=0, num_heads=NP, kv_heads=NG)


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_megatron_fused_qkv_equals_separate_leaves_bit_for_bit(alpha):
  separate, g_separate = clip_for(SEPARATE_HEADS, alpha)(SEPARATE, QKV_LOGITS)
  fused, g_fused = clip_for(FUSED_HEADS, alpha)(FUSED, QKV_LOGITS)
  for part in ("weight", "bias"):
    want = megatron_fuse(np.asarray(separate["q"][part]), np.asarray(separate["k"][part]),
                         SEPARATE["v"][part], NG)
    assert_bits(fused["linear_qkv"][part], want)
  assert_bits(g_fused, g_separate)
  assert_bits(separate["v"]["weight"], SEPARATE["v"]["weight"])  # values untouched


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_megatron_fused_qkv_matches_megatrons_clip_qk(alpha):
  fused, _ = clip_for(FUSED_HEADS, alpha)(FUSED, QKV_LOGITS)
  for layer in range(LAYERS):
    for part in ("weight", "bias"):
      want = megatron_clip_qk(FUSED["linear_qkv"][part][layer], QKV_LOGITS[layer], NP, NG,
                              alpha)
      got = np.asarray(fused["linear_qkv"][part][layer])
      if alpha == 0.5:
        assert_bits(got, want)
      else:  # XLA's pow and numpy's: within an ulp or two
        np.testing.assert_allclose(got, want, rtol=3e-7)


def test_flax_kernel_with_a_qkv_axis_equals_separate_leaves():
  # [in, 3, heads, head_dim] and biases [3, heads, head_dim], one entry per head.
  attn = MHA["attn"]
  fused = {"qkv": {"kernel": np.stack([attn[x]["kernel"] for x in ("query", "key", "value")],
                                      axis=1),
                   "bias": np.stack([attn["query"]["bias"], attn["key"]["bias"], rand(4, 3)])}}
  heads = oc.AttentionHeads(qkv="qkv", qkv_layout="concat", qkv_axis=-3, head_axis=-2)
  out, g = clip_for(heads)(fused, MHA_LOGITS)
  want, g_want = MHA_CLIP(MHA, MHA_LOGITS)
  for i, side in enumerate(("query", "key")):
    assert_bits(out["qkv"]["kernel"][:, i], want["attn"][side]["kernel"])
    assert_bits(out["qkv"]["bias"][i], want["attn"][side]["bias"])
  assert_bits(out["qkv"]["kernel"][:, 2], attn["value"]["kernel"])
  assert_bits(out["qkv"]["bias"][2], fused["qkv"]["bias"][2])
  assert_bits(g, g_want)


def test_concatenated_gqa_kernel_equals_separate_leaves():
  # [in, (heads + 2 * kv_heads) * head_dim]: every query head, every key, every value.
  q, k, v = (SEPARATE[x]["weight"][0].T for x in "qkv")  # [in, rows]
  separate = oc.AttentionHeads(query="q", key="k", head_axis=-1, num_heads=NP, kv_heads=NG)
  fused = separate._replace(query=(), key=(), qkv="qkv", qkv_layout="concat")
  out, _ = clip_for(separate)({"q": q, "k": k}, QKV_LOGITS[1])
  got, _ = clip_for(fused)({"qkv": np.concatenate([q, k, v], -1)}, QKV_LOGITS[1])
  assert_bits(got["qkv"], np.concatenate([out["q"], out["k"], v], -1))


def test_fused_qkv_through_the_transform_lands_on_the_rescaled_weights():
  tx = optax.chain(optax.sgd(0.01), oc.qk_clip(100.0, heads=FUSED_HEADS))
  grads = jax.tree.map(lambda x: rand(*x.shape), FUSED)
  logits = np.array([[130.0, 99.0, 100.0, 110.0], [1.0, 2.0, 3.0, 150.0]], np.float32)
  updates = jax.jit(lambda p, g, m: tx.update(g, tx.init(p), p, max_logits=m)[0])(
      FUSED, grads, logits)
  plain = jax.tree.map(lambda p, g: p + np.float32(-0.01) * g, FUSED, grads)
  assert_lands(FUSED, updates, clip_for(FUSED_HEADS)(plain, logits)[0])


def test_fused_qkv_sharded_by_group_equals_unsharded():
  # Tensor parallelism as Megatron's: each device holds whole key-value groups.
  heads, kv, hn = 16, 8, 2
  qkv = {"w": rand((heads + 2 * kv) * hn, 3)}
  logits = np.linspace(50.0, 400.0, heads).astype(np.float32)
  block = oc.AttentionHeads(qkv="w", qkv_layout="megatron", head_axis=0,
                            num_heads=heads, kv_heads=kv)
  mesh = make_mesh((8,), ("h",))
  sharded, _ = clip_for(block)(shard(qkv, mesh, {"w": P("h", None)}),
                               shard(logits, mesh, P("h")))
  want = megatron_clip_qk(qkv["w"], logits, heads, kv, 0.5)
  assert_bits(sharded["w"], want)


@pytest.mark.parametrize("fields,params,pattern", [
    (dict(num_heads=None), {"linear_qkv": FUSED["linear_qkv"]["weight"]},
     r"has 24 entries along its head axis \(1\), but max_logits has 4 heads \(8 query, "
     r"key and value heads \(4 \+ 2 x 2\)\)\. .*num_heads=4"),
    (dict(num_heads=5, kv_heads=None), {"linear_qkv": FUSED["linear_qkv"]["weight"]},
     r"has 24 entries along its head axis \(1\), not a multiple of its 15 query, key and "
     r"value heads \(5 \+ 2 x 5\)"),
    (dict(qkv_layout="concat", qkv_axis=0, kv_heads=None, layer_axis=None),
     {"linear_qkv": FUSED["linear_qkv"]["weight"]},
     r"leaf 'linear_qkv' has 2 entries along qkv_axis \(0\) and 4 key heads for 4 heads; "
     r"a kernel \[in, 3, heads, head_dim\] needs 3"),
])
def test_fused_qkv_shapes_are_checked(fields, params, pattern):
  heads = FUSED_HEADS._replace(**fields)
  logits = QKV_LOGITS if heads.layer_axis == 0 else QKV_LOGITS[0]
  with pytest.raises(ValueError, match=pattern):  # at init where num_heads is declared
    oc.qk_clip(100.0, heads=heads).init(params)
    jax.eval_shape(functools.partial(F.qk_clip, heads=heads), params, logits)


def test_a_leaf_is_fused_or_separate_not_both():
  heads = FUSED_HEADS._replace(query="linear_qkv")
  with pytest.raises(ValueError, match=r"leaf 'linear_qkv/bias' is selected twice "
                     r"\(AttentionHeads.query and AttentionHeads.qkv\)"):
    oc.qk_clip(100.0, heads=heads).init(FUSED)


def test_entry_factors_follow_the_leaf_axes_in_any_order():
  # A kernel [heads, in, 3, layers]: head axis before the qkv and layer axes.
  block = oc.AttentionHeads(qkv="w", qkv_layout="concat", qkv_axis=2, head_axis=0,
                            layer_axis=-1, num_heads=2)
  part = heads_module.Part(0, "w", heads_module.QKV, 0, 3, 2)
  table = jnp.arange(2 * 2 * 4, dtype=jnp.float32).reshape(2, 2, 4)  # [layers, kv, code]
  pieces = layout.entry_codes("qk_clip", "AttentionHeads", block, part, (4, 5, 3, 2), 2, 2)
  got = np.asarray(layout.leaf_factor(table, 1, pieces, part, 4))
  assert got.shape == (4, 1, 3, 2)  # 2 heads of 2 entries; q, k, v; 2 layers
  codes = (layout.Q, layout.K, layout.ONE)
  want = np.array([[[table[layer, entry // 2, codes[part_]] for layer in range(2)]
                    for part_ in range(3)] for entry in range(4)])
  np.testing.assert_array_equal(got[:, 0], want)
