"""float64 numpy references for the ops tests (the semantics the kernels must match)."""
import numpy as np


def group_bounds(group_sizes, rows):
    """Clamped cumulative layout: negative sizes count as 0, nothing past `rows`."""
    starts, acc = [], 0
    for s in np.asarray(group_sizes):
        starts.append(acc)
        acc = min(rows, acc + max(0, int(s)))
    return starts + [acc]


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
    G = len(group_sizes)
    out = np.zeros((G, lhs.shape[1], d_out.shape[1]))
    b = group_bounds(group_sizes, lhs.shape[0])
    for g in range(G):
        out[g] = lhs[b[g]:b[g + 1]].T @ d_out[b[g]:b[g + 1]]
    return out


def permute(x, expert_ids, num_experts):
    x, ids = np.asarray(x, np.float64), np.asarray(expert_ids)
    T, k = ids.shape
    order = [(e, s) for s, e in enumerate(ids.reshape(-1)) if 0 <= e < num_experts]
    order.sort(key=lambda es: es[0])  # stable: ties keep slot order
    x_sorted = np.zeros((T * k, x.shape[1]))
    row_index = -np.ones(T * k, np.int64)
    for r, (e, s) in enumerate(order):
        x_sorted[r] = x[s // k]
        row_index[s] = r
    sizes = np.bincount([e for e, _ in order], minlength=num_experts)
    return x_sorted, sizes, row_index.reshape(T, k)


def unpermute(y, row_index, weights):
    y, w = np.asarray(y, np.float64), np.asarray(weights, np.float64)
    T, k = row_index.shape
    out = np.zeros((T, y.shape[1]))
    for t in range(T):
        for j in range(k):
            if row_index[t, j] >= 0:
                out[t] += w[t, j] * y[row_index[t, j]]
    return out
