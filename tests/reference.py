"""Vectorised float64 numpy references of the ops (CPU and GPU tests share them; fast up to M = 131072)."""
import numpy as np


def group_bounds(group_sizes, rows):
    """Clamped cumulative layout: negative sizes count as 0, nothing past `rows`. (G+1,) int64."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), rows)
    return np.concatenate([[0], ends])


def grouped_gemm(lhs, rhs, group_sizes, transpose_rhs=False):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    b = group_bounds(group_sizes, lhs.shape[0])
    for g in range(rhs.shape[0]):
        out[b[g]:b[g + 1]] = lhs[b[g]:b[g + 1]] @ rhs[g]
    return out


def weight_grad(lhs, d_out, group_sizes):
    lhs, d_out = np.asarray(lhs, np.float64), np.asarray(d_out, np.float64)
    out = np.zeros((len(group_sizes), lhs.shape[1], d_out.shape[1]))
    b = group_bounds(group_sizes, lhs.shape[0])
    for g in range(len(group_sizes)):
        out[g] = lhs[b[g]:b[g + 1]].T @ d_out[b[g]:b[g + 1]]
    return out


def permute(x, expert_ids, num_experts):
    """-> x_sorted (T*k, H), group_sizes (E,), row_index (T, k): stable sort of the slots by expert."""
    x, ids = np.asarray(x, np.float64), np.asarray(expert_ids).reshape(-1)
    T, k = np.asarray(expert_ids).shape
    valid = (ids >= 0) & (ids < num_experts)
    slots = np.nonzero(valid)[0]
    order = slots[np.argsort(ids[slots], kind="stable")]
    row_index = -np.ones(T * k, np.int64)
    row_index[order] = np.arange(len(order))
    x_sorted = np.zeros((T * k, x.shape[1]))
    x_sorted[:len(order)] = x[order // k]
    sizes = np.bincount(ids[valid], minlength=num_experts)
    return x_sorted, sizes, row_index.reshape(T, k)


def unpermute(y, row_index, weights):
    y, w = np.asarray(y, np.float64), np.asarray(weights, np.float64)
    ok = (row_index >= 0) & (row_index < y.shape[0])
    rows = y[np.where(ok, row_index, 0)] * (w * ok)[..., None]  # (T, k, H)
    return rows.sum(axis=1)


def unpermute_bwd(d_out, y, row_index, weights):
    """-> d_y (R, H), d_weights (T, k)."""
    d_out, y, w = (np.asarray(a, np.float64) for a in (d_out, y, weights))
    ok = (row_index >= 0) & (row_index < y.shape[0])
    d_y = np.zeros_like(y)
    t, j = np.nonzero(ok)
    d_y[row_index[t, j]] = w[t, j, None] * d_out[t]
    d_w = np.zeros(row_index.shape)
    d_w[t, j] = np.einsum("nh,nh->n", d_out[t], y[row_index[t, j]])
    return d_y, d_w
