"""The ops of the torch parity test (see `torch_parity`): every op on torch's CPU autocast lists
(shared reference: autocast-ops.md) and the common ops on none, each as torch writes it and as a
JAX user writes it (jnp, jax.nn, optax, flax where that is the usual spelling).

`list` is where torch's CPU autocast puts the op (as torch 2.13 behaves: l1_loss is on its
float32 list too), `cuda` where its CUDA autocast does (torch's `autocast_mode.h` lists, a superset
of the docs' table: they also lower einsum, mv, linalg_vecdot and scaled_dot_product_attention,
keep nll_loss2d, huber_loss, logsumexp, linalg_vector_norm and the upsample ops in float32, and
promote vdot). An op on no CPU list that torch builds from listed ones (einsum, tensordot, inner,
chain_matmul, multi_dot, rnn_tanh_cell all run mm/bmm/matmul/linear), and a composite written out
(attention, a one-hot matmul), is filed under the list that decides its dtype: "lower".

Skipped, with the reason:
- `_convolution`: the op conv1d/2d/3d dispatch to; the same computation as the conv cases.
- `fractional_max_pool2d`, `fractional_max_pool3d`: random pooling regions, no JAX counterpart.
- `multilabel_margin_loss_forward`, `grid_sampler_2d`, `_grid_sampler_2d_cpu_fallback`,
  `grid_sampler_3d`, `fake_quantize_per_tensor_affine`, `_addmm_activation`: internal overloads
  of listed ops (or a quantization op no JAX user writes).
- `__rdiv__`: Python 2's name for `__rtruediv__`, which is a case.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import optax
from jax import lax

from torch_parity import Case


# -- input makers ---------------------------------------------------------------------------

def normal(*shape):
    return lambda rng: (rng.standard_normal(shape).astype(np.float32),)


def normals(*shapes):
    return lambda rng: tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


def uniform(lo, hi, *shape):
    return lambda rng: (rng.uniform(lo, hi, shape).astype(np.float32),)


def positive(*shape):
    return uniform(0.5, 2.0, *shape)


def signs(*shape):
    """±1 targets (hinge and margin losses)."""
    return lambda rng: (rng.choice([-1.0, 1.0], shape).astype(np.float32),)


def labels(classes, *shape):
    return lambda rng: (rng.integers(0, classes, shape),)


def spd(n):
    """A symmetric positive definite matrix."""
    def make(rng):
        a = rng.standard_normal((n, n))
        return ((a @ a.T + n * np.eye(n)).astype(np.float32),)
    return make


def invertible(*shape):
    """Well-conditioned square matrices (the last two dims)."""
    n = shape[-1]
    return lambda rng: ((rng.standard_normal(shape) + n * np.eye(n)).astype(np.float32),)


def cholesky_factor(n):
    return lambda rng: (np.linalg.cholesky(spd(n)(rng)[0]).astype(np.float32),)


def log_probs(*shape):
    def make(rng):
        z = rng.standard_normal(shape)
        return ((z - np.log(np.exp(z).sum(-1, keepdims=True))).astype(np.float32),)
    return make


def probs(*shape):
    """Rows of a distribution over the last axis."""
    return lambda rng: (np.exp(log_probs(*shape)(rng)[0]).astype(np.float32),)


def with_nans(*shape):
    def make(rng):
        x = rng.standard_normal(shape).astype(np.float32)
        x[..., 0] = np.nan
        return (x,)
    return make


def join(*makers):
    return lambda rng: tuple(v for m in makers for v in m(rng))


def unpool_inputs(*spatial):
    """Pooled values (1, 1, *spatial) and the flat indices of their maxima in a 2x larger map,
    as `max_pool(kernel 2, return_indices=True)` returns them."""
    def make(rng):
        x = rng.standard_normal((1, 1) + spatial).astype(np.float32)
        grid = np.meshgrid(*[np.arange(s) for s in spatial], indexing="ij")
        coords = [2 * g + rng.integers(0, 2, g.shape) for g in grid]
        return x, np.ravel_multi_index(coords, [2 * s for s in spatial])[None, None]
    return make


def lu_inputs(rng):
    """b, and the LU factors of a (4, 4) matrix with 0-based pivots (scipy's convention)."""
    import scipy.linalg
    a = invertible(4, 4)(rng)[0]
    lu, piv = scipy.linalg.lu_factor(a)
    return rng.standard_normal((4, 2)).astype(np.float32), lu.astype(np.float32), piv


def F(t):
    return t.nn.functional


# -- JAX helpers: what a JAX user writes for the composite ops --------------------------------

# lax's convolutions take one dtype: the inputs are promoted first, as flax's nn.Conv does.

def _conv(x, w, padding="VALID", spec=("NCH", "OIH", "NCH")):
    x, w = nn.dtypes.promote_dtype(x, w)
    return lax.conv_general_dilated(x, w, (1,) * (x.ndim - 2), padding, dimension_numbers=spec)


def _conv_transpose(x, w, spec):
    # torch's (in, out, *k) weight is the forward conv's (O, I, *k) kernel, flipped and swapped.
    x, w = nn.dtypes.promote_dtype(x, w)
    return lax.conv_transpose(x, w, (1,) * (x.ndim - 2), "VALID", dimension_numbers=spec,
                              transpose_kernel=True)


def _lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh):
    gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def _lstm_layer(xs, h0, c0, w_ih, w_hh, b_ih, b_hh):
    def step(carry, x):
        h, c = _lstm_step(x, *carry, w_ih, w_hh, b_ih, b_hh)
        return (h, c), h
    (h, c), ys = lax.scan(step, (h0[0], c0[0]), xs)
    return ys, h[None], c[None]


def _gru_step(x, h, w_ih, w_hh, b_ih, b_hh):
    xr, xz, xn = jnp.split(x @ w_ih.T + b_ih, 3, axis=-1)
    hr, hz, hn = jnp.split(h @ w_hh.T + b_hh, 3, axis=-1)
    r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    return (1 - z) * n + z * h


def _mha(x, w_qkv, b_qkv, w_o, b_o, heads=2):
    b, t, e = x.shape
    q, k, v = jnp.split(x @ w_qkv.T + b_qkv, 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, e // heads)
    o = jax.nn.dot_product_attention(split(q), split(k), split(v)).reshape(b, t, e)
    return o @ w_o.T + b_o


def _sdpa(q, k, v):
    # torch's layout is (batch, heads, time, dim); jax.nn's is (batch, time, heads, dim).
    bthd = lambda a: a.swapaxes(1, 2)
    return bthd(jax.nn.dot_product_attention(bthd(q), bthd(k), bthd(v)))


def _grid_sample(x, grid):
    """F.grid_sample(x, grid, align_corners=True) for one image and channel."""
    h, w = x.shape[-2:]
    cols = (grid[0, ..., 0] + 1) / 2 * (w - 1)
    rows = (grid[0, ..., 1] + 1) / 2 * (h - 1)
    return jsp.ndimage.map_coordinates(x[0, 0], [rows, cols], order=1, mode="constant")[None, None]


def _stft(x, window, n_fft=8, hop=4):
    starts = jnp.arange(0, x.shape[-1] - n_fft + 1, hop)
    frames = x[starts[:, None] + jnp.arange(n_fft)] * window
    return jnp.fft.rfft(frames, axis=-1).T


def _max_unpool(x, idx, out_spatial):
    n, c = x.shape[:2]
    flat = jnp.put_along_axis(jnp.zeros((n, c, math.prod(out_spatial)), x.dtype),
                              idx.reshape(n, c, -1), x.reshape(n, c, -1), axis=-1, inplace=False)
    return flat.reshape(n, c, *out_spatial)


def _blocks(x, k=2):
    """(N, C, *S) -> (N, C, S0/k, k, S1/k, k, ...): the windows of an adaptive pool to S/k."""
    return x.reshape(x.shape[:2] + tuple(d for s in x.shape[2:] for d in (s // k, k)))


def _nhwc(f):
    """Run a flax pooling function (channels last) on NCHW data."""
    return lambda x, *a, **kw: jnp.moveaxis(f(jnp.moveaxis(x, 1, -1), *a, **kw), -1, 1)


def _bce(p, y):
    log = lambda v: jnp.maximum(jnp.log(v), -100)  # torch clamps the logs at -100
    return -jnp.mean(y * log(p) + (1 - y) * log(1 - p))


def _nll(logp, y):
    return -jnp.mean(jnp.take_along_axis(logp, jnp.expand_dims(y, 1), axis=1))


def _cosine_embedding(a, b, y, eps=1e-12):
    cos = jnp.sum(a * b, -1) / jnp.sqrt((jnp.sum(a * a, -1) + eps) * (jnp.sum(b * b, -1) + eps))
    return jnp.mean(jnp.where(y == 1, 1 - cos, jnp.maximum(cos, 0)))


def _smooth_l1(a, b, beta=1.0):
    d = jnp.abs(a - b)
    return jnp.mean(jnp.where(d < beta, 0.5 * d ** 2 / beta, d - 0.5 * beta))


def _triplet(a, p, n, margin=1.0, eps=1e-6):
    d = lambda u, v: jnp.linalg.norm(u - v + eps, axis=-1)
    return jnp.mean(jax.nn.relu(d(a, p) - d(a, n) + margin))


def _multi_margin(x, y):
    c = x.shape[-1]
    margins = jax.nn.relu(1 - jnp.take_along_axis(x, y[:, None], -1) + x)
    return jnp.mean(jnp.sum(jnp.where(jax.nn.one_hot(y, c, dtype=bool), 0, margins), -1) / c)


def _multilabel_margin(x, y):
    c = x.shape[-1]
    valid = jnp.cumsum(y < 0, axis=-1) == 0  # the targets end at the first -1
    is_target = jnp.any(jax.nn.one_hot(y, c, dtype=bool) & valid[..., None], axis=-2)
    pairs = is_target[..., :, None] & ~is_target[..., None, :]
    hinge = jax.nn.relu(1 - (x[..., :, None] - x[..., None, :]))
    return jnp.mean(jnp.sum(jnp.where(pairs, hinge, 0), (-2, -1)) / c)


def _ctc(x, y):
    # x: (T, N, C) logits as torch lays them out; optax takes (N, T, C) and log-softmaxes itself.
    logits = jnp.swapaxes(x, 0, 1)
    return jnp.sum(optax.ctc_loss(logits, jnp.zeros(logits.shape[:2]), y, jnp.zeros(y.shape)))


def _batch_norm_eval(x, mean, var, w, b, eps=1e-5):
    c = lambda v: v[:, None]
    return (x - c(mean)) * lax.rsqrt(c(var) + eps) * c(w) + c(b)


def _batch_norm_train(x, w, b, eps=1e-5):
    mean, var = x.mean((0, 2), keepdims=True), x.var((0, 2), keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * w[:, None] + b[:, None]


def _group_norm(x, w, b, groups=2, eps=1e-5):
    g = x.reshape(x.shape[0], groups, -1)
    g = (g - g.mean(-1, keepdims=True)) * lax.rsqrt(g.var(-1, keepdims=True) + eps)
    return g.reshape(x.shape) * w[:, None] + b[:, None]


def _layer_norm(x, w, b, eps=1e-5):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * w + b


# Flax's normalizations take channels last; torch's (N, C, ...) data is moved there and back.

def _flax_layer_norm(x, w, b):
    return nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": w, "bias": b}}, x)


def _flax_group_norm(x, w, b):
    norm = nn.GroupNorm(num_groups=2, epsilon=1e-5)
    return jnp.moveaxis(norm.apply({"params": {"scale": w, "bias": b}}, jnp.moveaxis(x, 1, -1)),
                        -1, 1)


def _flax_batch_norm_train(x, w, b):
    norm = nn.BatchNorm(use_running_average=False, epsilon=1e-5)
    stats = {"mean": jnp.zeros(w.shape), "var": jnp.ones(w.shape)}
    y, _ = norm.apply({"params": {"scale": w, "bias": b}, "batch_stats": stats},
                      jnp.moveaxis(x, 1, -1), mutable=["batch_stats"])
    return jnp.moveaxis(y, -1, 1)


def _flax_prelu(x, w):
    # Flax's PReLU has one slope: torch's weight of one element.
    return nn.PReLU().apply({"params": {"negative_slope": w[0]}}, x)


def _renorm(x, maxnorm=1.0):
    norms = jnp.linalg.norm(x, axis=1, keepdims=True)
    return x * jnp.where(norms > maxnorm, maxnorm / (norms + 1e-7), 1.0)


def _pdist(x):
    i, j = jnp.triu_indices(x.shape[0], 1)
    return jnp.linalg.norm(x[i] - x[j], axis=-1)


# -- shapes ---------------------------------------------------------------------------------

LSTM = ((3, 2, 4), (1, 2, 3), (1, 2, 3), (12, 4), (12, 3), (12,), (12,))  # x, h0, c0, weights
CELL = ((2, 4), (2, 3), (9, 4), (9, 3), (9,), (9,))  # x, h, then GRU weights (3 gates)
WINDOW3 = (1, 1, 2, 2, 2)  # a 2x2x2 pooling window on (N, C, D, H, W)


CASES = [
    # ===================================================================================
    # torch CPU autocast: lower precision (bfloat16)
    # ===================================================================================
    Case("conv1d", "lower", lambda t, x, w, b: F(t).conv1d(x, w, b),
         lambda x, w, b: _conv(x, w) + b[:, None], normals((2, 3, 5), (4, 3, 3), (4,)),
         cuda="lower"),
    Case("conv2d", "lower", lambda t, x, w, b: F(t).conv2d(x, w, b, padding=1),
         lambda x, w, b: _conv(x, w, "SAME", ("NCHW", "OIHW", "NCHW")) + b[:, None, None],
         normals((2, 3, 5, 5), (4, 3, 3, 3), (4,)), cuda="lower"),
    Case("conv3d", "lower", lambda t, x, w: F(t).conv3d(x, w),
         lambda x, w: _conv(x, w, spec=("NCDHW", "OIDHW", "NCDHW")),
         normals((1, 2, 4, 4, 4), (3, 2, 3, 3, 3)), cuda="lower"),
    Case("conv_tbc", "lower", lambda t, x, w, b: t.conv_tbc(x, w, b, 1),
         lambda x, w, b: _conv(x, w, [(1, 1)], ("HNC", "HIO", "HNC")) + b,
         normals((5, 2, 3), (3, 3, 4), (4,)), cuda="lower"),
    Case("conv_transpose1d", "lower", lambda t, x, w, b: F(t).conv_transpose1d(x, w, b),
         lambda x, w, b: _conv_transpose(x, w, ("NCH", "OIH", "NCH")) + b[:, None],
         normals((2, 3, 5), (3, 4, 3), (4,)), cuda="lower"),
    Case("conv_transpose2d", "lower", lambda t, x, w: F(t).conv_transpose2d(x, w),
         lambda x, w: _conv_transpose(x, w, ("NCHW", "OIHW", "NCHW")),
         normals((2, 3, 4, 4), (3, 2, 3, 3)), cuda="lower"),
    Case("conv_transpose3d", "lower", lambda t, x, w: F(t).conv_transpose3d(x, w),
         lambda x, w: _conv_transpose(x, w, ("NCDHW", "OIDHW", "NCDHW")),
         normals((1, 2, 3, 3, 3), (2, 2, 2, 2, 2)), cuda="lower"),
    Case("mm", "lower", lambda t, a, b: t.mm(a, b), lambda a, b: a @ b, normals((3, 4), (4, 5)),
         cuda="lower"),
    Case("bmm", "lower", lambda t, a, b: t.bmm(a, b), lambda a, b: a @ b,
         normals((2, 3, 4), (2, 4, 5)), cuda="lower"),
    Case("matmul", "lower", lambda t, a, b: t.matmul(a, b), jnp.matmul,
         normals((2, 3, 4), (4, 5)), cuda="lower"),
    Case("__matmul__", "lower", lambda t, a, b: a @ b, lambda a, b: a @ b,
         normals((3, 4), (4,)), cuda="lower"),
    Case("linalg_vecdot", "lower", lambda t, a, b: t.linalg.vecdot(a, b), jnp.linalg.vecdot,
         normals((3, 4), (3, 4)), cuda="lower"),
    Case("baddbmm", "lower", lambda t, c, a, b: t.baddbmm(c, a, b), lambda c, a, b: c + a @ b,
         normals((2, 3, 5), (2, 3, 4), (2, 4, 5)), low=(1,), cuda="lower"),
    Case("addmm", "lower", lambda t, c, a, b: t.addmm(c, a, b), lambda c, a, b: c + a @ b,
         normals((5,), (3, 4), (4, 5)), low=(1,), cuda="lower"),
    Case("addbmm", "lower", lambda t, c, a, b: t.addbmm(c, a, b),
         lambda c, a, b: c + jnp.einsum("bij,bjk->ik", a, b),
         normals((3, 5), (2, 3, 4), (2, 4, 5)), low=(1,), cuda="lower"),
    Case("linear", "lower", lambda t, x, w, b: F(t).linear(x, w, b),
         lambda x, w, b: x @ w.T + b, normals((3, 4), (5, 4), (5,)), cuda="lower"),
    Case("mkldnn_rnn_layer", "lower",  # one LSTM layer over a sequence (torch.nn.LSTM's op)
         lambda t, x, h, c, *w: t.lstm(x, (h, c), w, True, 1, 0.0, False, False, False),
         _lstm_layer, normals(*LSTM), cuda="lower"),  # CUDA: _cudnn_rnn, cast to float16
    Case("prelu", "lower", lambda t, x, w: F(t).prelu(x, w), _flax_prelu,
         normals((2, 3, 4), (1,)), cuda="lower"),
    Case("scaled_dot_product_attention", "lower",
         lambda t, q, k, v: F(t).scaled_dot_product_attention(q, k, v), _sdpa,
         normals((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), low=(0, 1, 2), cuda="lower"),
    Case("_native_multi_head_attention", "lower",
         lambda t, x, wi, bi, wo, bo: t._native_multi_head_attention(
             x, x, x, 4, 2, wi, bi, wo, bo, need_weights=False)[0],
         _mha, normals((2, 3, 4), (12, 4), (12,), (4, 4), (4,))),
    # On no CPU list, but torch runs them as mm, bmm, matmul or linear, which are. Where torch
    # refuses mixed dtypes (before reaching those), the "mixed" variant makes every input bfloat16.
    Case("einsum", "lower", lambda t, a, b: t.einsum("bij,bjk->bik", a, b),
         lambda a, b: jnp.einsum("bij,bjk->bik", a, b), normals((2, 3, 4), (2, 4, 5)),
         cuda="lower"),
    Case("chain_matmul", "lower", lambda t, a, b, c: t.chain_matmul(a, b, c),
         lambda a, b, c: a @ b @ c, normals((3, 4), (4, 5), (5, 2)), low=(0, 1, 2),
         cuda="lower"),
    Case("multi_dot", "lower", lambda t, a, b, c: t.linalg.multi_dot([a, b, c]),
         lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), normals((3, 4), (4, 5), (5, 2)),
         low=(0, 1, 2), cuda="lower"),
    Case("RNNCell", "lower", lambda t, x, h, *w: t.rnn_tanh_cell(x, h, *w),
         lambda x, h, w_ih, w_hh, b_ih, b_hh: jnp.tanh(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh),
         normals((2, 4), (2, 3), (3, 4), (3, 3), (3,), (3,)), cuda="lower"),  # rnn_tanh_cell
    Case("tensordot", "lower", lambda t, a, b: t.tensordot(a, b, dims=2),
         lambda a, b: jnp.tensordot(a, b, axes=2), normals((2, 3, 4), (3, 4, 5)), low=(0, 1),
         cuda="promote"),
    Case("inner", "lower", lambda t, a, b: t.inner(a, b), jnp.inner, normals((3, 4), (5, 4)),
         low=(0, 1)),
    # Composites whose dtype the lowered matmul decides.
    Case("attention", "lower",
         lambda t, q, k, v: t.softmax(q @ k.transpose(-2, -1) / 2.0, -1) @ v,
         lambda q, k, v: jax.nn.softmax(q @ k.swapaxes(-2, -1) / 2.0) @ v,
         normals((2, 3, 4), (2, 3, 4), (2, 3, 4)), cuda="lower"),
    Case("one_hot_matmul", "lower", lambda t, y, w: F(t).one_hot(y, 5).float() @ w,
         lambda y, w: jax.nn.one_hot(y, 5) @ w, join(labels(5, 3), normal(5, 4)), cuda="lower"),

    # ===================================================================================
    # torch CPU autocast: float32
    # ===================================================================================
    # -- pooling and padding
    Case("avg_pool3d", "fp32", lambda t, x: F(t).avg_pool3d(x, 2),
         lambda x: lax.reduce_window(x, 0.0, lax.add, WINDOW3, WINDOW3, "VALID") / 8,
         normal(1, 2, 4, 4, 4)),
    Case("max_pool3d", "fp32", lambda t, x: F(t).max_pool3d(x, 2),
         lambda x: lax.reduce_window(x, -jnp.inf, lax.max, WINDOW3, WINDOW3, "VALID"),
         normal(1, 2, 4, 4, 4)),
    Case("adaptive_avg_pool3d", "fp32", lambda t, x: F(t).adaptive_avg_pool3d(x, 2),
         lambda x: _blocks(x).mean((3, 5, 7)), normal(1, 2, 4, 4, 4)),
    Case("adaptive_max_pool3d", "fp32", lambda t, x: F(t).adaptive_max_pool3d(x, 2),
         lambda x: _blocks(x).max((3, 5, 7)), normal(1, 2, 4, 4, 4)),
    Case("max_unpool2d", "fp32", lambda t, x, i: F(t).max_unpool2d(x, i, 2),
         lambda x, i: _max_unpool(x, i, (4, 4)), unpool_inputs(2, 2)),
    Case("max_unpool3d", "fp32", lambda t, x, i: F(t).max_unpool3d(x, i, 2),
         lambda x, i: _max_unpool(x, i, (4, 4, 4)), unpool_inputs(2, 2, 2)),
    Case("reflection_pad1d", "fp32", lambda t, x: F(t).pad(x, (2, 1), mode="reflect"),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1)), mode="reflect"), normal(1, 2, 5)),
    Case("reflection_pad2d", "fp32", lambda t, x: F(t).pad(x, (1, 2, 2, 1), mode="reflect"),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1), (1, 2)), mode="reflect"),
         normal(1, 2, 4, 4)),
    Case("replication_pad1d", "fp32", lambda t, x: F(t).pad(x, (2, 1), mode="replicate"),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1)), mode="edge"), normal(1, 2, 5)),
    Case("replication_pad2d", "fp32", lambda t, x: F(t).pad(x, (1, 2, 2, 1), mode="replicate"),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1), (1, 2)), mode="edge"), normal(1, 2, 4, 4)),
    Case("replication_pad3d", "fp32",
         lambda t, x: F(t).pad(x, (1, 1, 0, 1, 1, 0), mode="replicate"),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 1), (1, 1)), mode="edge"),
         normal(1, 2, 3, 3, 3)),
    Case("grid_sampler", "fp32",
         lambda t, x, g: F(t).grid_sample(x, g, align_corners=True), _grid_sample,
         join(normal(1, 1, 4, 4), uniform(-1, 1, 1, 3, 3, 2)), cuda="promote"),
    # -- reductions and signal
    Case("prod", "fp32", lambda t, x: t.prod(x, -1), lambda x: jnp.prod(x, -1),
         uniform(0.5, 1.5, 3, 4), cuda="fp32"),
    Case("quantile", "fp32", lambda t, x: t.quantile(x, 0.3, dim=-1),
         lambda x: jnp.quantile(x, 0.3, axis=-1), normal(3, 5)),
    Case("nanquantile", "fp32", lambda t, x: t.nanquantile(x, 0.3, dim=-1),
         lambda x: jnp.nanquantile(x, 0.3, axis=-1), with_nans(3, 5)),
    Case("quantile/typed", "fp32", lambda t, x, q: t.quantile(x, q, dim=-1),
         lambda x, q: jnp.quantile(x, q, axis=-1), join(normal(3, 5), uniform(0.2, 0.8, 1)),
         typed=True),
    Case("nanquantile/typed", "fp32", lambda t, x: t.nanquantile(x, 0.3, dim=-1),
         lambda x: jnp.nanquantile(x, 0.3, axis=-1), with_nans(3, 5), typed=True),
    Case("trace", "fp32", lambda t, x: t.trace(x), jnp.trace, normal(4, 4)),
    Case("cdist", "fp32", lambda t, a, b: t.cdist(a, b),
         lambda a, b: jnp.sqrt(jnp.sum((a[:, None] - b[None]) ** 2, -1)),
         normals((3, 4), (5, 4)), cuda="fp32"),
    Case("stft", "fp32",
         lambda t, x, w: t.stft(x, 8, hop_length=4, window=w, center=False, return_complex=True),
         _stft, join(normal(16), uniform(0, 1, 8))),
    Case("fft_fft", "fp32", lambda t, x: t.fft.fft(x), jnp.fft.fft, normal(3, 8)),
    Case("fft_ifft", "fp32", lambda t, x: t.fft.ifft(x), jnp.fft.ifft, normal(3, 8)),
    # jnp.fft.rfft/rfftn refuse bfloat16 when traced (before autocast sees the program), so
    # bfloat16 data is upcast first, as a JAX user must.
    Case("fft_rfft", "fp32", lambda t, x: t.fft.rfft(x),
         lambda x: jnp.fft.rfft(x.astype(jnp.float32)), normal(3, 8)),
    Case("fft_irfft", "fp32", lambda t, x: t.fft.irfft(x), jnp.fft.irfft, normal(3, 5)),
    Case("fft_fft2", "fp32", lambda t, x: t.fft.fft2(x), jnp.fft.fft2, normal(2, 4, 4)),
    Case("fft_rfftn", "fp32", lambda t, x: t.fft.rfftn(x),
         lambda x: jnp.fft.rfftn(x.astype(jnp.float32)), normal(2, 4, 4)),
    Case("fft_ifftn", "fp32", lambda t, x: t.fft.ifftn(x), jnp.fft.ifftn, normal(2, 4, 4)),
    Case("fft_hfft", "fp32", lambda t, x: t.fft.hfft(x), jnp.fft.hfft, normal(3, 5)),
    # -- complex numbers
    Case("polar", "fp32", lambda t, r, a: t.polar(r, a), lambda r, a: r * jnp.exp(1j * a),
         join(positive(3, 4), normal(3, 4))),
    Case("view_as_complex", "fp32", lambda t, x: t.view_as_complex(x),
         lambda x: x[..., 0] + 1j * x[..., 1], normal(3, 4, 2)),
    # -- linear algebra
    Case("cholesky", "fp32", lambda t, a: t.cholesky(a), jnp.linalg.cholesky, spd(4)),
    Case("cholesky_inverse", "fp32", lambda t, c: t.cholesky_inverse(c),
         lambda c: jsp.linalg.cho_solve((c, True), jnp.eye(4)), cholesky_factor(4)),
    Case("cholesky_solve", "fp32", lambda t, b, c: t.cholesky_solve(b, c),
         lambda b, c: jsp.linalg.cho_solve((c, True), b), join(normal(4, 2), cholesky_factor(4))),
    Case("inverse", "fp32", lambda t, a: t.inverse(a), jnp.linalg.inv, invertible(4, 4)),
    Case("lu_solve", "fp32", lambda t, b, lu, piv: t.lu_solve(b, lu, (piv + 1).int()),
         lambda b, lu, piv: jsp.linalg.lu_solve((lu, piv), b), lu_inputs),
    Case("_lu_with_info", "fp32", lambda t, a: t.lu(a), jsp.linalg.lu_factor, invertible(4, 4)),
    # a and tau come from one geqrf and share a dtype (lax's householder ops demand it).
    Case("orgqr", "fp32", lambda t, a, tau: t.orgqr(a, tau), lax.linalg.householder_product,
         join(normal(4, 3), uniform(1, 2, 3)), low=(0, 1)),
    Case("ormqr", "fp32", lambda t, a, tau, c: t.ormqr(a, tau, c), lax.linalg.ormqr,
         join(normal(4, 3), uniform(1, 2, 3), normal(4, 2)), low=(0, 1, 2)),
    Case("pinverse", "fp32", lambda t, a: t.pinverse(a), jnp.linalg.pinv, normal(4, 3)),
    Case("geqrf", "fp32", lambda t, a: t.geqrf(a),  # numpy's raw mode returns geqrf's a.T
         lambda a: (lambda h, tau: (h.T, tau))(*jnp.linalg.qr(a, mode="raw")), normal(4, 3)),
    Case("qr", "fp32", lambda t, a: t.qr(a), jnp.linalg.qr, normal(4, 3)),
    Case("svd", "fp32", lambda t, a: t.svd(a),
         lambda a: (lambda u, s, vh: (u, s, vh.mT))(*jnp.linalg.svd(a, full_matrices=False)),
         normal(4, 3)),
    Case("triangular_solve", "fp32", lambda t, b, a: t.triangular_solve(b, a.triu())[0],
         lambda b, a: jsp.linalg.solve_triangular(jnp.triu(a), b, lower=False),
         join(normal(4, 2), invertible(4, 4))),
    Case("linalg_cond", "fp32", lambda t, a: t.linalg.cond(a), jnp.linalg.cond, invertible(4, 4)),
    Case("linalg_matrix_rank", "fp32", lambda t, a: t.linalg.matrix_rank(a),
         jnp.linalg.matrix_rank, normal(4, 3)),
    Case("linalg_solve", "fp32", lambda t, a, b: t.linalg.solve(a, b), jnp.linalg.solve,
         join(invertible(4, 4), normal(4, 2))),
    Case("linalg_cholesky", "fp32", lambda t, a: t.linalg.cholesky(a), jnp.linalg.cholesky, spd(4)),
    Case("linalg_cholesky_ex", "fp32", lambda t, a: t.linalg.cholesky_ex(a).L,
         jnp.linalg.cholesky, spd(4)),
    Case("linalg_svdvals", "fp32", lambda t, a: t.linalg.svdvals(a), jnp.linalg.svdvals,
         normal(4, 3)),
    Case("linalg_svd", "fp32", lambda t, a: t.linalg.svd(a, full_matrices=False),
         lambda a: jnp.linalg.svd(a, full_matrices=False), normal(4, 3)),
    Case("linalg_eigvals", "fp32", lambda t, a: t.linalg.eigvals(a), jnp.linalg.eigvals,
         normal(4, 4)),
    Case("linalg_eig", "fp32", lambda t, a: t.linalg.eig(a), jnp.linalg.eig, normal(4, 4)),
    Case("linalg_eigvalsh", "fp32", lambda t, a: t.linalg.eigvalsh(a), jnp.linalg.eigvalsh,
         spd(4)),
    Case("linalg_eigh", "fp32", lambda t, a: t.linalg.eigh(a), jnp.linalg.eigh, spd(4)),
    Case("linalg_inv", "fp32", lambda t, a: t.linalg.inv(a), jnp.linalg.inv, invertible(4, 4)),
    Case("linalg_inv_ex", "fp32", lambda t, a: t.linalg.inv_ex(a).inverse, jnp.linalg.inv,
         invertible(4, 4)),
    Case("linalg_householder_product", "fp32",
         lambda t, a, tau: t.linalg.householder_product(a, tau), lax.linalg.householder_product,
         join(normal(4, 3), uniform(1, 2, 2)), low=(0, 1)),
    Case("linalg_tensorinv", "fp32", lambda t, a: t.linalg.tensorinv(a, ind=1),
         lambda a: jnp.linalg.tensorinv(a, ind=1),
         lambda rng: (invertible(4, 4)(rng)[0].reshape(4, 2, 2),)),
    Case("linalg_tensorsolve", "fp32", lambda t, a, b: t.linalg.tensorsolve(a, b),
         jnp.linalg.tensorsolve,
         lambda rng: (invertible(6, 6)(rng)[0].reshape(2, 3, 6),
                      rng.standard_normal((2, 3)).astype(np.float32))),
    Case("linalg_qr", "fp32", lambda t, a: t.linalg.qr(a), jnp.linalg.qr, normal(4, 3)),
    Case("linalg_lstsq", "fp32", lambda t, a, b: t.linalg.lstsq(a, b).solution,
         lambda a, b: jnp.linalg.lstsq(a, b)[0], normals((5, 3), (5, 2))),
    # -- losses
    Case("binary_cross_entropy", "fp32", lambda t, p, y: F(t).binary_cross_entropy(p, y),
         _bce, join(uniform(0.05, 0.95, 3, 4), uniform(0, 1, 3, 4))),  # CUDA refuses it
    Case("binary_cross_entropy_with_logits", "fp32",
         lambda t, x, y: F(t).binary_cross_entropy_with_logits(x, y),
         lambda x, y: optax.sigmoid_binary_cross_entropy(x, y).mean(),
         join(normal(3, 4), uniform(0, 1, 3, 4)), cuda="fp32"),
    Case("binary_cross_entropy_with_logits/none", "fp32",
         lambda t, x, y: F(t).binary_cross_entropy_with_logits(x, y, reduction="none"),
         optax.sigmoid_binary_cross_entropy, join(normal(3, 4), uniform(0, 1, 3, 4)),
         cuda="fp32"),
    Case("binary_cross_entropy_with_logits/none/typed", "fp32",
         lambda t, x, y: F(t).binary_cross_entropy_with_logits(x, y, reduction="none"),
         optax.sigmoid_binary_cross_entropy, join(normal(3, 4), uniform(0, 1, 3, 4)),
         cuda="fp32", typed=True),
    Case("mse_loss", "fp32", lambda t, a, b: F(t).mse_loss(a, b),
         lambda a, b: jnp.mean((a - b) ** 2), normals((3, 4), (3, 4)), cuda="fp32"),
    Case("l1_loss", "fp32", lambda t, a, b: F(t).l1_loss(a, b),
         lambda a, b: jnp.mean(jnp.abs(a - b)), normals((3, 4), (3, 4)), cuda="fp32"),
    Case("smooth_l1_loss", "fp32", lambda t, a, b: F(t).smooth_l1_loss(a, b), _smooth_l1,
         normals((3, 4), (3, 4)), cuda="fp32"),
    Case("huber_loss", "fp32", lambda t, a, b: F(t).huber_loss(a, b),
         lambda a, b: optax.huber_loss(a, b, delta=1.0).mean(), normals((3, 4), (3, 4)),
         cuda="fp32"),
    Case("cross_entropy_loss", "fp32", lambda t, x, y: F(t).cross_entropy(x, y),
         lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
         join(normal(3, 5), labels(5, 3)), cuda="fp32"),
    Case("cross_entropy_probs", "fp32", lambda t, x, p: F(t).cross_entropy(x, p),
         lambda x, p: optax.softmax_cross_entropy(x, p).mean(), join(normal(3, 5), probs(3, 5)),
         cuda="fp32"),
    Case("cross_entropy_probs/typed", "fp32",
         lambda t, x, p: F(t).cross_entropy(x, p, reduction="none"), optax.softmax_cross_entropy,
         join(normal(3, 5), probs(3, 5)), low=(0, 1), cuda="fp32", typed=True),
    Case("nll_loss", "fp32", lambda t, x, y: F(t).nll_loss(x, y), _nll,
         join(log_probs(3, 5), labels(5, 3)), cuda="fp32"),
    Case("nll_loss2d", "fp32", lambda t, x, y: F(t).nll_loss(x, y), _nll,
         join(lambda rng: (log_probs(2, 2, 2, 3)(rng)[0].transpose(0, 3, 1, 2).copy(),),
              labels(3, 2, 2, 2)), cuda="fp32"),
    Case("kl_div", "fp32", lambda t, q, p: F(t).kl_div(q, p, reduction="batchmean"),
         lambda q, p: optax.kl_divergence(q, p).mean(), join(log_probs(3, 4), probs(3, 4)),
         cuda="fp32"),
    Case("poisson_nll_loss", "fp32", lambda t, x, y: F(t).poisson_nll_loss(x, y),
         lambda x, y: jnp.mean(jnp.exp(x) - y * x), join(normal(3, 4), uniform(0, 3, 3, 4)),
         cuda="fp32"),
    Case("cosine_embedding_loss", "fp32",
         lambda t, a, b, y: F(t).cosine_embedding_loss(a, b, y), _cosine_embedding,
         join(normals((3, 4), (3, 4)), signs(3)), cuda="fp32"),
    Case("hinge_embedding_loss", "fp32", lambda t, x, y: F(t).hinge_embedding_loss(x, y),
         lambda x, y: jnp.mean(jnp.where(y == 1, x, jax.nn.relu(1 - x))),
         join(normal(3, 4), signs(3, 4)), cuda="fp32"),
    Case("margin_ranking_loss", "fp32", lambda t, a, b, y: F(t).margin_ranking_loss(a, b, y),
         lambda a, b, y: jnp.mean(jax.nn.relu(-y * (a - b))),
         join(normals((5,), (5,)), signs(5)), cuda="fp32"),
    # max(0, 1 - y * (a - b)): optax's hinge loss of the difference.
    Case("margin_ranking_loss/optax", "fp32",
         lambda t, a, b, y: F(t).margin_ranking_loss(a, b, y, reduction="none"),
         lambda a, b, y: optax.hinge_loss(a - b, y), join(normals((5,), (5,)), signs(5)),
         cuda="fp32"),
    Case("margin_ranking_loss/optax/typed", "fp32",
         lambda t, a, b, y: F(t).margin_ranking_loss(a, b, y),
         lambda a, b, y: optax.hinge_loss(a - b, y).mean(), join(normals((5,), (5,)), signs(5)),
         low=(0, 1, 2), cuda="fp32", typed=True),
    Case("soft_margin_loss", "fp32", lambda t, x, y: F(t).soft_margin_loss(x, y),
         lambda x, y: jnp.mean(jax.nn.softplus(-y * x)), join(normal(3, 4), signs(3, 4)),
         cuda="fp32"),
    Case("triplet_margin_loss", "fp32", lambda t, a, p, n: F(t).triplet_margin_loss(a, p, n),
         _triplet, normals((3, 4), (3, 4), (3, 4)), cuda="fp32"),
    Case("multi_margin_loss", "fp32", lambda t, x, y: F(t).multi_margin_loss(x, y),
         _multi_margin, join(normal(3, 5), labels(5, 3)), cuda="fp32"),
    Case("multilabel_margin_loss", "fp32", lambda t, x, y: F(t).multilabel_margin_loss(x, y),
         _multilabel_margin,
         join(normal(2, 4), lambda rng: (np.array([[3, 0, -1, 2], [1, -1, 0, 0]]),)),
         cuda="fp32"),
    Case("ctc_loss", "fp32",
         lambda t, x, y: F(t).ctc_loss(x.log_softmax(-1), y, (5, 5), (2, 2), reduction="sum"),
         _ctc, join(normal(5, 2, 4), lambda rng: (rng.integers(1, 4, (2, 2)),))),

    # ===================================================================================
    # On no CPU list; on CUDA's lists. torch refuses mixed dtypes for some of these outside
    # autocast: their "mixed" variant makes every floating input bfloat16.
    # ===================================================================================
    # -- CUDA lower precision
    Case("mv", "none", lambda t, a, x: t.mv(a, x), lambda a, x: a @ x, normals((3, 4), (4,)),
         low=(0, 1), cuda="lower"),
    Case("addmv", "none", lambda t, b, a, x: t.addmv(b, a, x), lambda b, a, x: b + a @ x,
         normals((3,), (3, 4), (4,)), low=(0, 1, 2), cuda="lower"),
    Case("addr", "none", lambda t, m, a, b: t.addr(m, a, b), lambda m, a, b: m + jnp.outer(a, b),
         normals((3, 4), (3,), (4,)), low=(0, 1, 2), cuda="lower"),
    # lstm_cell and gru_cell are fused kernels on CPU: on no list, float32 in, float32 out.
    Case("LSTMCell", "none",
         lambda t, x, h, c, *w: t.lstm_cell(x, (h, c), *w), _lstm_step,
         normals((2, 4), (2, 3), (2, 3), (12, 4), (12, 3), (12,), (12,)), cuda="lower"),
    Case("GRUCell", "none", lambda t, x, h, *w: t.gru_cell(x, h, *w), _gru_step, normals(*CELL),
         cuda="lower"),
    # -- CUDA float32: pointwise
    Case("exp", "none", lambda t, x: t.exp(x), jnp.exp, normal(3, 4), cuda="fp32"),
    Case("expm1", "none", lambda t, x: t.expm1(x), jnp.expm1, normal(3, 4), cuda="fp32"),
    Case("log", "none", lambda t, x: t.log(x), jnp.log, positive(3, 4), cuda="fp32"),
    Case("log1p", "none", lambda t, x: t.log1p(x), jnp.log1p, positive(3, 4), cuda="fp32"),
    Case("log2", "none", lambda t, x: t.log2(x), jnp.log2, positive(3, 4), cuda="fp32"),
    Case("log10", "none", lambda t, x: t.log10(x), jnp.log10, positive(3, 4), cuda="fp32"),
    Case("pow", "none", lambda t, a, b: t.pow(a, b), lambda a, b: a ** b,
         join(positive(3, 4), normal(3, 4)), cuda="fp32"),
    Case("__pow__", "none", lambda t, x: x ** 2, lambda x: x ** 2, normal(3, 4), cuda="fp32"),
    Case("__rpow__", "none", lambda t, x: 2.0 ** x, lambda x: 2.0 ** x, normal(3, 4),
         cuda="fp32"),
    Case("__rtruediv__", "none", lambda t, x: 1.0 / x, lambda x: 1.0 / x, positive(3, 4),
         cuda="fp32"),
    Case("reciprocal", "none", lambda t, x: t.reciprocal(x), jnp.reciprocal, positive(3, 4),
         cuda="fp32"),
    Case("rsqrt", "none", lambda t, x: t.rsqrt(x), lax.rsqrt, positive(3, 4), cuda="fp32"),
    Case("acos", "none", lambda t, x: t.acos(x), jnp.arccos, uniform(-0.9, 0.9, 3, 4),
         cuda="fp32"),
    Case("asin", "none", lambda t, x: t.asin(x), jnp.arcsin, uniform(-0.9, 0.9, 3, 4),
         cuda="fp32"),
    Case("cosh", "none", lambda t, x: t.cosh(x), jnp.cosh, normal(3, 4), cuda="fp32"),
    Case("sinh", "none", lambda t, x: t.sinh(x), jnp.sinh, normal(3, 4), cuda="fp32"),
    Case("tan", "none", lambda t, x: t.tan(x), jnp.tan, uniform(-1, 1, 3, 4), cuda="fp32"),
    Case("erfinv", "none", lambda t, x: t.erfinv(x), jsp.special.erfinv,
         uniform(-0.9, 0.9, 3, 4), cuda="fp32"),
    Case("softplus", "none", lambda t, x: F(t).softplus(x), jax.nn.softplus, normal(3, 4),
         cuda="fp32"),
    # -- CUDA float32: reductions, normalizations, distances
    Case("sum", "none", lambda t, x: t.sum(x, -1), lambda x: jnp.sum(x, -1), normal(3, 4),
         cuda="fp32"),
    Case("cumsum", "none", lambda t, x: t.cumsum(x, -1), lambda x: jnp.cumsum(x, -1),
         normal(3, 4), cuda="fp32"),
    Case("cumprod", "none", lambda t, x: t.cumprod(x, -1), lambda x: jnp.cumprod(x, -1),
         uniform(0.5, 1.5, 3, 4), cuda="fp32"),
    Case("logsumexp", "none", lambda t, x: t.logsumexp(x, -1),
         lambda x: jax.nn.logsumexp(x, -1), normal(3, 4), cuda="fp32"),
    Case("softmax", "none", lambda t, a: t.softmax(a, -1), jax.nn.softmax, normal(3, 4),
         cuda="fp32"),
    Case("softmin", "none", lambda t, x: F(t).softmin(x, -1), lambda x: jax.nn.softmax(-x),
         normal(3, 4), cuda="fp32"),
    Case("log_softmax", "none", lambda t, x: t.log_softmax(x, -1), jax.nn.log_softmax,
         normal(3, 4), cuda="fp32"),
    Case("layer_norm", "none", lambda t, x, w, b: F(t).layer_norm(x, (4,), w, b), _layer_norm,
         normals((3, 4), (4,), (4,)), cuda="fp32"),
    Case("group_norm", "none", lambda t, x, w, b: F(t).group_norm(x, 2, w, b), _group_norm,
         normals((2, 4, 3), (4,), (4,)), cuda="fp32"),
    Case("norm", "none", lambda t, x: t.norm(x), jnp.linalg.norm, normal(3, 4), cuda="fp32"),
    Case("linalg_vector_norm", "none", lambda t, x: t.linalg.vector_norm(x, dim=-1),
         lambda x: jnp.linalg.vector_norm(x, axis=-1), normal(3, 4), cuda="fp32"),
    Case("normalize", "none", lambda t, x: F(t).normalize(x, dim=-1),
         lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12),
         normal(3, 4), cuda="fp32"),
    Case("dist", "none", lambda t, a, b: t.dist(a, b), lambda a, b: jnp.linalg.norm(a - b),
         normals((3, 4), (3, 4)), cuda="fp32"),
    Case("pdist", "none", lambda t, x: F(t).pdist(x), _pdist, normal(4, 3), cuda="fp32"),
    Case("cosine_similarity", "none", lambda t, a, b: F(t).cosine_similarity(a, b, dim=-1),
         lambda a, b: optax.cosine_similarity(a, b, epsilon=1e-8), normals((3, 4), (3, 4)),
         cuda="fp32"),
    Case("cosine_similarity/both", "none",
         lambda t, a, b: F(t).cosine_similarity(a, b, dim=-1),
         lambda a, b: optax.cosine_similarity(a, b, epsilon=1e-8), normals((3, 4), (3, 4)),
         low=(0, 1), cuda="fp32"),
    Case("cosine_similarity/typed", "none",
         lambda t, a, b: F(t).cosine_similarity(a, b, dim=-1),
         lambda a, b: optax.cosine_similarity(a, b, epsilon=1e-8), normals((3, 4), (3, 4)),
         cuda="fp32", typed=True),
    Case("renorm", "none", lambda t, x: t.renorm(x, 2, 0, 1.0), _renorm, normal(3, 4),
         cuda="fp32"),
    Case("interpolate", "none",
         lambda t, x: F(t).interpolate(x, size=(6, 6), mode="bilinear", align_corners=False),
         lambda x: jax.image.resize(x, (1, 2, 6, 6), "bilinear"), normal(1, 2, 3, 3),
         cuda="fp32"),
    # -- CUDA promote
    Case("addcdiv", "none", lambda t, x, a, b: t.addcdiv(x, a, b, value=0.5),
         lambda x, a, b: x + 0.5 * a / b, join(normals((3, 4), (3, 4)), positive(3, 4)),
         cuda="promote"),
    Case("addcmul", "none", lambda t, x, a, b: t.addcmul(x, a, b, value=0.5),
         lambda x, a, b: x + 0.5 * a * b, normals((3, 4), (3, 4), (3, 4)), cuda="promote"),
    Case("atan2", "none", lambda t, a, b: t.atan2(a, b), jnp.arctan2, normals((3, 4), (3, 4)),
         cuda="promote"),
    Case("bilinear", "none", lambda t, a, b, w, c: F(t).bilinear(a, b, w, c),
         lambda a, b, w, c: jnp.einsum("ni,oij,nj->no", a, w, b) + c,
         normals((3, 4), (3, 5), (2, 4, 5), (2,)), low=(0, 1, 2, 3), cuda="promote"),
    Case("cross", "none", lambda t, a, b: t.cross(a, b, dim=-1), jnp.cross,
         normals((4, 3), (4, 3)), low=(0, 1), cuda="promote"),
    Case("dot", "none", lambda t, a, b: t.dot(a, b), jnp.dot, normals((4,), (4,)),
         low=(0, 1), cuda="promote"),
    Case("vdot", "none", lambda t, a, b: t.vdot(a, b), jnp.vdot, normals((4,), (4,)),
         low=(0, 1), cuda="promote"),
    Case("index_put", "none", lambda t, x, v, i: x.index_put((i,), v, accumulate=True),
         lambda x, v, i: x.at[i].add(v), join(normals((5, 3), (2, 3)), labels(5, 2)),
         low=(0, 1), cuda="promote"),
    Case("scatter_add", "none", lambda t, x, s, i: x.scatter_add(0, i, s),
         lambda x, s, i: x.at[i, jnp.arange(3)].add(s),
         join(normals((5, 3), (2, 3)), labels(5, 2, 3)), low=(0, 1),
         cuda="promote"),

    # ===================================================================================
    # On no list: torch's CPU promote list (cat, stack, index_copy) and common ops
    # ===================================================================================
    Case("cat", "none", lambda t, a, b: t.cat([a, b]), lambda a, b: jnp.concatenate([a, b]),
         normals((2, 4), (3, 4))),
    Case("stack", "none", lambda t, a, b: t.stack([a, b]), lambda a, b: jnp.stack([a, b]),
         normals((3, 4), (3, 4))),
    Case("index_copy", "none", lambda t, x, s, i: x.index_copy(0, i, s),
         lambda x, s, i: x.at[i].set(s),
         join(normals((5, 3), (2, 3)), lambda rng: (rng.permutation(5)[:2],))),
    # -- arithmetic
    Case("add", "none", lambda t, a, b: a + b, lambda a, b: a + b, normals((3, 4), (3, 4))),
    Case("add_scalar", "none", lambda t, x: x + 1.5, lambda x: x + 1.5, normal(3, 4)),
    Case("sub", "none", lambda t, a, b: a - b, lambda a, b: a - b, normals((3, 4), (4,))),
    Case("rsub_scalar", "none", lambda t, x: 1.0 - x, lambda x: 1.0 - x, normal(3, 4)),
    Case("mul", "none", lambda t, a, b: a * b, lambda a, b: a * b, normals((3, 4), (3, 4))),
    Case("mul_scalar", "none", lambda t, x: x * 2.0, lambda x: x * 2.0, normal(3, 4)),
    Case("div", "none", lambda t, a, b: a / b, lambda a, b: a / b,
         join(normal(3, 4), positive(3, 4))),
    Case("div_scalar", "none", lambda t, x: x / 3.0, lambda x: x / 3.0, normal(3, 4)),
    Case("lerp", "none", lambda t, a, b: t.lerp(a, b, 0.1), lambda a, b: a + 0.1 * (b - a),
         normals((3, 4), (3, 4)), low=(0, 1)),
    Case("maximum", "none", lambda t, a, b: t.maximum(a, b), jnp.maximum,
         normals((3, 4), (3, 4))),
    Case("where", "none", lambda t, a, b: t.where(a > 0, a, b), lambda a, b: jnp.where(a > 0, a, b),
         normals((3, 4), (3, 4))),
    Case("clamp", "none", lambda t, x: t.clamp(x, -0.5, 0.5), lambda x: jnp.clip(x, -0.5, 0.5),
         normal(3, 4)),
    Case("abs", "none", lambda t, x: t.abs(x), jnp.abs, normal(3, 4)),
    Case("sqrt", "none", lambda t, x: t.sqrt(x), jnp.sqrt, positive(3, 4)),
    Case("square", "none", lambda t, x: t.square(x), jnp.square, normal(3, 4)),
    Case("sin", "none", lambda t, x: t.sin(x), jnp.sin, normal(3, 4)),
    Case("erf", "none", lambda t, x: t.erf(x), jsp.special.erf, normal(3, 4)),
    Case("masked_fill", "none", lambda t, x: x.masked_fill(x < 0, -1e4),
         lambda x: jnp.where(x < 0, -1e4, x), normal(3, 4)),
    # -- activations
    Case("relu", "none", lambda t, x: t.relu(x), jax.nn.relu, normal(3, 4)),
    Case("gelu", "none", lambda t, x: F(t).gelu(x), lambda x: jax.nn.gelu(x, approximate=False),
         normal(3, 4)),
    Case("gelu_tanh", "none", lambda t, x: F(t).gelu(x, approximate="tanh"), jax.nn.gelu,
         normal(3, 4)),
    Case("silu", "none", lambda t, x: F(t).silu(x), jax.nn.silu, normal(3, 4)),
    Case("sigmoid", "none", lambda t, x: t.sigmoid(x), jax.nn.sigmoid, normal(3, 4)),
    Case("tanh", "none", lambda t, x: t.tanh(x), jnp.tanh, normal(3, 4)),
    Case("leaky_relu", "none", lambda t, x: F(t).leaky_relu(x, 0.1),
         lambda x: jax.nn.leaky_relu(x, 0.1), normal(3, 4)),
    Case("elu", "none", lambda t, x: F(t).elu(x), jax.nn.elu, normal(3, 4)),
    Case("logsigmoid", "none", lambda t, x: F(t).logsigmoid(x), jax.nn.log_sigmoid,
         normal(3, 4)),
    Case("glu", "none", lambda t, x: F(t).glu(x, -1), jax.nn.glu, normal(3, 4)),
    Case("mish", "none", lambda t, x: F(t).mish(x), jax.nn.mish, normal(3, 4)),
    # -- reductions
    Case("mean", "none", lambda t, x: t.mean(x, -1), lambda x: jnp.mean(x, -1), normal(3, 4)),
    Case("var", "none", lambda t, x: t.var(x, -1), lambda x: jnp.var(x, -1, ddof=1),
         normal(3, 4)),
    Case("std", "none", lambda t, x: t.std(x, -1), lambda x: jnp.std(x, -1, ddof=1),
         normal(3, 4)),
    Case("amax", "none", lambda t, x: t.amax(x, -1), lambda x: jnp.max(x, -1), normal(3, 4)),
    Case("max_dim", "none", lambda t, x: t.max(x, -1).values, lambda x: jnp.max(x, -1),
         normal(3, 4)),
    Case("argmax", "none", lambda t, x: t.argmax(x, -1), lambda x: jnp.argmax(x, -1),
         normal(3, 4)),
    Case("topk", "none", lambda t, x: t.topk(x, 2).values, lambda x: lax.top_k(x, 2)[0],
         normal(3, 5)),
    Case("sort", "none", lambda t, x: t.sort(x, -1).values, lambda x: jnp.sort(x, -1),
         normal(3, 5)),
    # -- pooling, resampling, indexing
    Case("max_pool2d", "none", lambda t, x: F(t).max_pool2d(x, 2),
         lambda x: _nhwc(nn.max_pool)(x, (2, 2), strides=(2, 2)), normal(1, 2, 4, 4)),
    Case("avg_pool2d", "none", lambda t, x: F(t).avg_pool2d(x, 2),
         lambda x: _nhwc(nn.avg_pool)(x, (2, 2), strides=(2, 2)), normal(1, 2, 4, 4)),
    Case("adaptive_avg_pool2d", "none", lambda t, x: F(t).adaptive_avg_pool2d(x, 1),
         lambda x: x.mean((2, 3), keepdims=True), normal(1, 2, 4, 4)),
    Case("pad", "none", lambda t, x: F(t).pad(x, (1, 1)),
         lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 1))), normal(1, 2, 4)),
    Case("embedding", "none", lambda t, i, w: F(t).embedding(i, w), lambda i, w: w[i],
         join(labels(5, 2, 3), normal(5, 4))),
    Case("gather", "none", lambda t, x, i: t.gather(x, 1, i),
         lambda x, i: jnp.take_along_axis(x, i, 1), join(normal(3, 4), labels(4, 3, 2))),
    Case("tril", "none", lambda t, x: t.tril(x), jnp.tril, normal(4, 4)),
    # -- normalization
    Case("batch_norm", "none",
         lambda t, x, m, v, w, b: F(t).batch_norm(x, m, v, w, b, training=False),
         _batch_norm_eval, join(normal(2, 3, 4), normal(3), positive(3), normals((3,), (3,)))),
    Case("batch_norm_train", "none",
         lambda t, x, w, b: F(t).batch_norm(x, None, None, w, b, training=True),
         _batch_norm_train, normals((2, 3, 4), (3,), (3,))),
    Case("layer_norm/flax", "none", lambda t, x, w, b: F(t).layer_norm(x, (4,), w, b),
         _flax_layer_norm, normals((3, 4), (4,), (4,)), cuda="fp32"),
    Case("layer_norm/flax/typed", "none", lambda t, x, w, b: F(t).layer_norm(x, (4,), w, b),
         _flax_layer_norm, normals((3, 4), (4,), (4,)), cuda="fp32", typed=True),
    Case("group_norm/flax", "none", lambda t, x, w, b: F(t).group_norm(x, 2, w, b),
         _flax_group_norm, normals((2, 4, 3), (4,), (4,)), cuda="fp32"),
    Case("group_norm/flax/typed", "none", lambda t, x, w, b: F(t).group_norm(x, 2, w, b),
         _flax_group_norm, normals((2, 4, 3), (4,), (4,)), cuda="fp32", typed=True),
    Case("batch_norm_train/flax", "none",
         lambda t, x, w, b: F(t).batch_norm(x, None, None, w, b, training=True),
         _flax_batch_norm_train, normals((2, 3, 4), (3,), (3,))),
    Case("batch_norm_train/flax/typed", "none",
         lambda t, x, w, b: F(t).batch_norm(x, None, None, w, b, training=True),
         _flax_batch_norm_train, normals((2, 3, 4), (3,), (3,)), typed=True),
    Case("rms_norm", "none", lambda t, x, w: F(t).rms_norm(x, (4,), w, eps=1e-6),
         lambda x, w: x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w,
         normals((3, 4), (4,))),
    # -- products with no list of their own
    Case("outer", "none", lambda t, a, b: t.outer(a, b), jnp.outer, normals((3,), (4,))),
    Case("kron", "none", lambda t, a, b: t.kron(a, b), jnp.kron, normals((2, 2), (2, 3))),
]
