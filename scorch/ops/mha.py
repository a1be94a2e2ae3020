"""``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, and through it ``nn.TransformerEncoderLayer`` /
``DecoderLayer``) with sparse projection weights, or a sparse ``attn_mask``.

torch's function is followed step by step (the same checks, mask merging, head split and attention), with two
differences:

- **the projections** are ``F.linear`` calls, so a sparse ``in_proj_weight`` (packed q/k/v), ``q_proj_weight`` /
  ``k_proj_weight`` / ``v_proj_weight`` or ``out_proj.weight`` runs scorch's dense-activation x sparse-weight
  kernels, forward and backward (the weight's gradient on its pattern). Self-attention projects with the packed
  weight in one product (no split); cross-attention splits the packed weight's rows (``split``, whose gradient
  reaches the packed weight's values), as torch does;
- **a sparse ``attn_mask``** (any scorch format; ``(L, S)`` or ``(N * heads, L, S)``) lists the (query, key) pairs
  that attend, as for ``F.scaled_dot_product_attention``'s sparse rule (``ops.attention``): a bool mask's stored
  True entries, a float mask's stored entries with their values added to the scores; every other pair is masked
  out. (The opposite of MHA's dense bool mask, where True masks a pair out: a sparse mask of the masked-out pairs
  would be a dense attention.) The attention then runs only at the mask's entries, by the SDPA rule's kernels. A
  ``key_padding_mask``, ``bias_k`` / ``bias_v`` or ``add_zero_attn`` with it: see ``_sparse_mask_attention``.

Everything else (dense masks, ``need_weights`` averaged or per head, ``is_causal``, dropout) is torch's own code on
dense tensors, so values, gradients and random draws are torch's given the dense weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..engine.convert import coo_from_entries
from ..sparse_tensor import SparseTensor, dense_fallback, implements
from . import attention

_MHA = F.multi_head_attention_forward


def _is_sparse(x) -> bool:
    return type(x) is SparseTensor


@implements(_MHA)
def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                 training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                 v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False):
    """torch.nn.functional.multi_head_attention_forward with sparse projection weights (packed ``in_proj_weight``,
    separate q/k/v weights, ``out_proj_weight``) run by ``F.linear``'s sparse-weight kernels, and a sparse
    ``attn_mask`` listing the pairs that attend (the module's documentation); otherwise torch's computation."""
    dense_args = (query, key, value, in_proj_bias, bias_k, bias_v, out_proj_bias, key_padding_mask, static_k, static_v)
    if any(_is_sparse(x) for x in dense_args):
        # (a sparse activation, bias or padding mask: torch's computation on the dense form, visibly)
        return dense_fallback(_MHA, (query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                     bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias),
                              dict(training=training, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, use_separate_proj_weight=use_separate_proj_weight,
                                   q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight,
                                   v_proj_weight=v_proj_weight, static_k=static_k, static_v=static_v,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal))
    sparse_mask = _is_sparse(attn_mask)
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=None if sparse_mask else F._none_or_dtype(attn_mask),
                                         other_name="attn_mask", target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if sparse_mask:
        pass  # (kept as it is: the SDPA rule intersects it with the causal mask where is_causal)
    elif is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # (torch's: the mask is the causal one, SDPA's is_causal says so)
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    if use_separate_proj_weight:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                                 f"{value.shape[:2]}")
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is True but q_proj_weight, k_proj_weight or v_proj_weight"
                                 " is None")
        b_q, b_k, b_v = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = F._in_projection(query, key, value, q_proj_weight, k_proj_weight, v_proj_weight, b_q, b_k, b_v)
    else:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        q, k, v = F._in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, src_len)}.")
            if not sparse_mask:
                attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(bsz * num_heads, tgt_len, src_len)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    extra_keys = 0  # (the keys bias_k and add_zero_attn append: a sparse mask lets every query attend them)
    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise AssertionError("bias cannot be added to static key or value.")
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        extra_keys += 1
        if attn_mask is not None and not sparse_mask:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must both be set or both be None")
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = _heads(k, static_k, bsz, num_heads, head_dim, "static_k")
    v = _heads(v, static_v, bsz, num_heads, head_dim, "static_v")
    if add_zero_attn:
        zeros = torch.zeros((bsz * num_heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros.to(v.dtype)], dim=1)
        extra_keys += 1
        if attn_mask is not None and not sparse_mask:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        F._check_key_padding_mask(key_padding_mask, src_len, bsz)
        key_padding_mask = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(
            bsz * num_heads, 1, src_len)
        if attn_mask is None:
            attn_mask = key_padding_mask
        elif not sparse_mask:
            attn_mask = attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0
    if sparse_mask:
        out, weights = _sparse_mask_attention(q, k, v, attn_mask, key_padding_mask, extra_keys, dropout_p,
                                              is_causal, need_weights)
    elif need_weights:
        out, weights = _explicit_attention(q, k, v, attn_mask, dropout_p, is_causal)
    else:
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3 else \
                attn_mask.view(bsz, num_heads, -1, src_len)
        out = F.scaled_dot_product_attention(q.view(bsz, num_heads, tgt_len, head_dim),
                                             k.view(bsz, num_heads, src_len, head_dim),
                                             v.view(bsz, num_heads, src_len, head_dim), attn_mask, dropout_p,
                                             is_causal)
        out, weights = out.view(bsz * num_heads, tgt_len, head_dim), None
    out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias).reshape(tgt_len, bsz, -1)
    if weights is not None:
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    if not is_batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def _heads(x, static, bsz, num_heads, head_dim, name):
    """``x`` (``(S, N, E)``) split into heads, ``(N * heads, S, head_dim)``; or ``static`` (checked) in its place."""
    if static is None:  # (reshape: a sparse weight's projection is a transposed, non-contiguous, product)
        return x.reshape(x.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    if static.size(0) != bsz * num_heads:
        raise AssertionError(f"expecting {name}.size(0) of {bsz * num_heads}, but got {static.size(0)}")
    if static.size(2) != head_dim:
        raise AssertionError(f"expecting {name}.size(2) of {head_dim}, but got {static.size(2)}")
    return static


def _explicit_attention(q, k, v, attn_mask, dropout_p, is_causal):
    """torch's ``need_weights`` path: the probabilities made explicitly (they are returned), ``(N * heads, L, S)``."""
    if is_causal and attn_mask is None:
        raise AssertionError("FIXME: is_causal not implemented for need_weights")
    q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
    scores = torch.bmm(q_scaled, k.transpose(-2, -1)) if attn_mask is None else \
        torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
    weights = F.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.bmm(weights, v), weights


def _sparse_mask_attention(q, k, v, mask, kpm, extra_keys, dropout_p, is_causal, need_weights):
    """The attention of ``q`` ``(N * heads, L, E)``, ``k``, ``v`` ``(N * heads, S, E)`` at the pairs the sparse
    ``mask`` lists (``(L, S - extra_keys)`` or ``(N * heads, L, S - extra_keys)``), merged with the canonical
    (float) ``key_padding_mask`` ``(N * heads, 1, S)`` and the ``extra_keys`` last keys (``bias_k``,
    ``add_zero_attn``), which every query attends as MHA's zero-padded dense mask lets it: ``(out, weights)``, the
    weights ``(N * heads, L, S)`` (0 off the mask) where ``need_weights``. Without them, the SDPA rule's fused
    kernels; with them, its three sparse ops (SDDMM, row softmax, SpMM) with the probabilities kept."""
    nh, L, S = q.shape[0], q.shape[1], k.shape[1]
    if kpm is not None or extra_keys:
        mask = _merged_mask(mask, kpm, nh, L, S, extra_keys, q.dtype)
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal), None
    batch, E = (nh,), q.shape[-1]
    pattern, _, src, keep_from = attention._pattern(mask, batch, L, S, is_causal, q.dtype)
    bias = None if mask.dtype == torch.bool else \
        attention._bias(mask, src, keep_from, q.dtype, (batch, L, S, is_causal))[0]
    scores = attention._scores(pattern, q.reshape(nh * L, E), k.reshape(nh * S, E), 1.0 / math.sqrt(E), bias)
    probs = torch.sparse.softmax(scores, 1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    out = (probs @ v.reshape(nh * S, v.shape[-1])).reshape(nh, L, v.shape[-1])
    rows, cols, vals = _csr_entries(probs)
    # (block b of the block-diagonal pattern is problem b: its column c is key c % S of row r's problem)
    weights = torch.zeros(nh * L * S, dtype=vals.dtype, device=vals.device).index_put((rows * S + cols % S,), vals)
    return out, weights.view(nh, L, S)


def _csr_entries(s):
    """A CSR SparseTensor's ``(rows, cols, values)``, one per stored entry (int64 coordinates)."""
    pos = s._levels[1].pos.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff())
    return rows, s._levels[1].crd.to(torch.int64), s._vals


def _merged_mask(mask, kpm, nh, L, S, extra_keys, dtype):
    """The ``(N * heads, L, S)`` COO mask of ``mask``'s allowed entries (broadcast over the heads where 2-d), the
    ``extra_keys`` last keys for every query, less the keys ``kpm`` masks out (``-inf``), plus ``kpm``'s finite
    values (float then, as MHA's merged dense mask is); a float mask's values keep their gradient."""
    mb, l, s, at, keep_from, _ = attention._mask_entries(mask, L, S - extra_keys, 3, False)
    dev = l.device
    vals = None
    if mask.dtype != torch.bool:
        vals = mask._vals.reshape(-1).to(dtype)
        if keep_from is not None:  # (duplicates of an uncoalesced COO mask: summed, as its dense form has them)
            stored, inverse, count = keep_from
            vals = torch.zeros(count, dtype=dtype, device=dev).index_add(0, inverse, vals[stored])
        vals = vals[at]
    if mask.dim() == 2:  # one mask for every (batch, head) problem
        n = l.numel()
        mb = torch.arange(nh, device=dev).repeat_interleave(n)
        l, s = l.repeat(nh), s.repeat(nh)
        vals = None if vals is None else vals.repeat(nh)
    if extra_keys:
        count = nh * L * extra_keys
        mb = torch.cat([mb, torch.arange(nh, device=dev).repeat_interleave(L * extra_keys)])
        l = torch.cat([l, torch.arange(L, device=dev).repeat_interleave(extra_keys).repeat(nh)])
        s = torch.cat([s, (S - extra_keys + torch.arange(extra_keys, device=dev)).repeat(nh * L)])
        vals = None if vals is None else torch.cat([vals, torch.zeros(count, dtype=dtype, device=dev)])
    if kpm is not None:
        add = kpm.reshape(nh, S).to(dtype)[mb, s]
        vals = add if vals is None else vals + add
        keep = ~torch.isneginf(vals.detach())
        mb, l, s, vals = mb[keep], l[keep], s[keep], vals[keep]
    if vals is None:
        vals = torch.ones(l.numel(), dtype=torch.bool, device=dev)
    return coo_from_entries([mb, l, s], vals, (nh, L, S), duplicates=False)
