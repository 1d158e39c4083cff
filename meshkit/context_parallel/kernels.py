"""One local attention op returning (out, lse), the unit every context-parallel algorithm composes.

Ring attention needs more than `scaled_dot_product_attention` gives: the per-row log-sum-exp (to merge
blocks), and a backward that takes the FINAL merged output and lse rather than the block's own (so a
block's gradient is its exact share of the global softmax). The fused kernels provide both through
private aten ops; this module hides them behind:

* `attention_forward` / `attention_backward`: no autograd, used inside ring.py's autograd Function.
* `attention_block`: the same as a differentiable op (``meshkit::attention_block``), used by
  Ulysses, where the local kernel sees whole sequences and needs no merging.
* `reference_attention`: explicit scores in the input dtype (fp64-capable), plain autograd. Tests
  compare everything against it; `backend="reference"` also routes the ops through it
  (`scores.py`), and so does any block with soft-capped scores (Gemma 2), which no fused kernel
  computes.

Masks: ``causal_kind`` is ``"none"`` or ``"causal"``. ``"causal"`` is only accepted on square blocks,
because SDPA's ``is_causal`` is top-left aligned when Sq != Sk, which is the wrong diagonal for a
query block that sits after its key block. Document ids (``q_doc_BS``, ``kv_doc_BS``: one integer per
token, equal within a packed document) add a block-diagonal mask on top, and a sliding ``window``
(with the global positions of the block's queries and keys, ``q_pos_S`` and ``kv_pos_S``) a band;
the CPU kernel and CUDA's memory-efficient kernel take them as an additive bias.

Empty rows (every key masked, e.g. a document absent from this key block) are normalised to
``out = 0`` and ``lse = -inf`` whatever the kernel returned (flash: +inf, CPU: 0), so merges can treat
"no contribution" uniformly. The backward maps an lse of -inf to +inf so such rows get zero gradient
instead of exp(-inf - -inf) = NaN.

GQA: K/V may have fewer heads than Q. The CPU and CUDA flash kernels take that natively; only the
kernels that cannot (efficient, cuDNN, reference) expand K/V locally, after any communication.

The CUDA paths are thin wrappers over the same aten ops that torch's SDPA dispatches to; they were not
run in this repository's CI (CPU only) and are kept minimal for that reason.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from meshkit._compat.dispatch import sdpa_op
from meshkit.context_parallel.scores import (
    acc_dtype,
    block_mask,
    expand_kv,
    reduce_kv_grad,
    scores_backward,
    scores_forward,
)

CausalKind = Literal["none", "causal"]
Backend = Literal["auto", "cpu_flash", "flash", "efficient", "cudnn", "reference"]
CAUSAL_KINDS = ("none", "causal")
BACKENDS = ("auto", "cpu_flash", "flash", "efficient", "cudnn", "reference")


def default_scale(head_dim: int) -> float:
    """1/sqrt(head_dim), SDPA's default softmax scale."""
    return 1.0 / math.sqrt(head_dim)


def _check(q_BHSD, k_BHSD, v_BHSD, causal_kind, q_doc_BS, kv_doc_BS, dropout_p=0.0, *, window=None,
           q_pos_S=None, kv_pos_S=None) -> None:
    if dropout_p:
        raise ValueError(
            f"attention dropout_p={dropout_p} is not supported: exact dropout under context parallelism "
            "needs the RNG state of every block step; set the model's attention_dropout to 0"
        )
    if causal_kind not in CAUSAL_KINDS:
        raise ValueError(f"causal_kind={causal_kind!r}; use one of {CAUSAL_KINDS}")
    if q_BHSD.dim() != 4 or k_BHSD.dim() != 4 or v_BHSD.shape != k_BHSD.shape:
        raise ValueError(
            f"expected q [B, H, Sq, D] and k, v [B, Hkv, Sk, D]; got {tuple(q_BHSD.shape)}, "
            f"{tuple(k_BHSD.shape)}, {tuple(v_BHSD.shape)}"
        )
    B, H, Sq, D = q_BHSD.shape
    Bk, Hkv, Sk, Dk = k_BHSD.shape
    if Bk != B or Dk != D or Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q {tuple(q_BHSD.shape)} and k {tuple(k_BHSD.shape)} disagree: batch and head dim must "
            f"match and q heads ({H}) must be a multiple of kv heads ({Hkv})"
        )
    if causal_kind == "causal" and Sq != Sk:
        raise ValueError(
            f"causal_kind='causal' needs a square block (Sq == Sk), got Sq={Sq}, Sk={Sk}: SDPA's causal "
            "mask is top-left aligned, which is wrong for off-diagonal blocks"
        )
    if (q_doc_BS is None) != (kv_doc_BS is None):
        raise ValueError("document masking needs both q_doc_BS and kv_doc_BS (or neither)")
    if q_doc_BS is not None and (tuple(q_doc_BS.shape), tuple(kv_doc_BS.shape)) != ((B, Sq), (B, Sk)):
        raise ValueError(
            f"document ids must be [B, Sq] = {(B, Sq)} and [B, Sk] = {(B, Sk)}, got "
            f"{tuple(q_doc_BS.shape)} and {tuple(kv_doc_BS.shape)}"
        )
    if window and (q_pos_S is None or kv_pos_S is None or (len(q_pos_S), len(kv_pos_S)) != (Sq, Sk)):
        raise ValueError(f"window={window} needs the positions of the block's {Sq} queries and {Sk} keys "
                         f"(q_pos_S, kv_pos_S)")


def _empty_result(q_BHSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros_like(q_BHSD)
    lse = torch.full(q_BHSD.shape[:3], -math.inf, dtype=acc_dtype(q_BHSD.dtype), device=q_BHSD.device)
    return out, lse


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -math.inf)


# ---------------------------------------------------------------------------------------------------
# reference


def reference_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal_kind: CausalKind = "none",
    scale: float | None = None,
    q_doc_BS: torch.Tensor | None = None,
    kv_doc_BS: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    q_pos_S: torch.Tensor | None = None,
    kv_pos_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit-scores attention in the input dtype (fp64-capable), differentiable by plain autograd
    (`scores.scores_forward`). Empty rows give out = 0, lse = -inf and zero (not NaN) gradients."""
    _check(q_BHSD, k_BHSD, v_BHSD, causal_kind, q_doc_BS, kv_doc_BS, window=window, q_pos_S=q_pos_S,
           kv_pos_S=kv_pos_S)
    Sq, Sk = q_BHSD.shape[2], k_BHSD.shape[2]
    scale = default_scale(q_BHSD.shape[-1]) if scale is None else scale
    keep = block_mask(Sq, Sk, causal_kind, q_doc_BS, kv_doc_BS, q_BHSD.device, explicit=True, window=window,
                      q_pos_S=q_pos_S, kv_pos_S=kv_pos_S)
    return scores_forward(q_BHSD, k_BHSD, v_BHSD, keep, scale, softcap)


# ---------------------------------------------------------------------------------------------------
# fused kernels (no autograd)


def _pick_backend(backend: str, q_BHSD: torch.Tensor, has_mask: bool) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    if backend != "auto":
        return backend
    if q_BHSD.device.type == "cpu":
        return "cpu_flash"
    # SDPA pads head dims to a multiple of 8 before calling these aten ops; we call them directly,
    # so other head dims (and fp64) take the reference path on CUDA.
    if q_BHSD.device.type == "cuda" and q_BHSD.shape[-1] % 8 == 0 and q_BHSD.dtype != torch.float64:
        if not has_mask and q_BHSD.dtype in (torch.float16, torch.bfloat16) and q_BHSD.shape[-1] <= 256:
            return "flash"
        return "efficient"
    return "reference"


def _cuda_bias(keep: torch.Tensor | None, dtype, heads: int, Sq: int, Sk: int) -> torch.Tensor | None:
    """Additive bias for the CUDA kernels: last dim padded to 16 elements for alignment, then sliced."""
    if keep is None:
        return None
    padded = -(-Sk // 16) * 16
    bias = torch.full((keep.shape[0], 1, Sq, padded), -math.inf, dtype=dtype, device=keep.device)
    bias[..., :Sk].masked_fill_(keep, 0.0)
    return bias[..., :Sk].expand(keep.shape[0], heads, Sq, Sk)


def attention_forward(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal_kind: CausalKind = "none",
    scale: float | None = None,
    q_doc_BS: torch.Tensor | None = None,
    kv_doc_BS: torch.Tensor | None = None,
    backend: Backend = "auto",
    softcap: float | None = None,
    window: int | None = None,
    q_pos_S: torch.Tensor | None = None,
    kv_pos_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B,H,Sq,D] in q's dtype, lse [B,H,Sq] fp32 (fp64 for fp64 inputs)) of one block.

    softcap: scores c * tanh(x / c) (explicit scores, `scores.py`); window: keys within `window`
    positions of the query (`q_pos_S`, `kv_pos_S`: the block's global token positions)."""
    _check(q_BHSD, k_BHSD, v_BHSD, causal_kind, q_doc_BS, kv_doc_BS, window=window, q_pos_S=q_pos_S,
           kv_pos_S=kv_pos_S)
    B, H, Sq, D = q_BHSD.shape
    Sk = k_BHSD.shape[2]
    scale = default_scale(D) if scale is None else scale
    if Sq == 0 or Sk == 0:  # the CPU kernel divides by zero on empty blocks
        return _empty_result(q_BHSD)
    band = dict(window=window, q_pos_S=q_pos_S, kv_pos_S=kv_pos_S)
    keep = block_mask(Sq, Sk, causal_kind, q_doc_BS, kv_doc_BS, q_BHSD.device, **band)
    causal = causal_kind == "causal" and keep is None
    kind = _pick_backend(backend, q_BHSD, keep is not None)
    if kind == "reference" or softcap:
        acc = acc_dtype(q_BHSD.dtype)
        keep = block_mask(Sq, Sk, causal_kind, q_doc_BS, kv_doc_BS, q_BHSD.device, explicit=True, **band)
        with torch.no_grad():
            out, lse = scores_forward(q_BHSD.to(acc), k_BHSD.to(acc), v_BHSD.to(acc), keep, scale, softcap)
        return out.to(q_BHSD.dtype), lse
    if kind == "cpu_flash":
        mask = None if keep is None else _additive(keep, q_BHSD.dtype)
        out, lse = sdpa_op("_scaled_dot_product_flash_attention_for_cpu")(
            q_BHSD, k_BHSD, v_BHSD, 0.0, causal, attn_mask=mask, scale=scale
        )
    elif kind == "flash":  # CUDA, native GQA, no mask support
        out, lse = sdpa_op("_scaled_dot_product_flash_attention")(
            q_BHSD, k_BHSD, v_BHSD, 0.0, causal, False, scale=scale
        )[:2]
    elif kind == "efficient":
        bias = _cuda_bias(keep, q_BHSD.dtype, H, Sq, Sk)
        out, lse = sdpa_op("_scaled_dot_product_efficient_attention")(
            q_BHSD, expand_kv(k_BHSD, H), expand_kv(v_BHSD, H), bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., :Sq]  # padded to a multiple of 32 rows
    elif kind == "cudnn":
        bias = _cuda_bias(keep, q_BHSD.dtype, H, Sq, Sk)
        out, lse = sdpa_op("_scaled_dot_product_cudnn_attention")(
            q_BHSD, expand_kv(k_BHSD, H), expand_kv(v_BHSD, H), bias, True, 0.0, causal, False,
            scale=scale,
        )[:2]
        lse = lse.reshape(B, H, -1)[..., :Sq]
    else:  # pragma: no cover - _pick_backend returns only the above
        raise AssertionError(kind)
    lse = lse.to(acc_dtype(q_BHSD.dtype))
    if keep is not None:
        nonempty_BHS = keep.any(-1).expand(B, H, Sq)
        out = torch.where(nonempty_BHS[..., None], out, 0.0).to(q_BHSD.dtype)
        lse = torch.where(nonempty_BHS, lse, -math.inf)
    return out, lse


def attention_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    *,
    causal_kind: CausalKind = "none",
    scale: float | None = None,
    q_doc_BS: torch.Tensor | None = None,
    kv_doc_BS: torch.Tensor | None = None,
    backend: Backend = "auto",
    softcap: float | None = None,
    window: int | None = None,
    q_pos_S: torch.Tensor | None = None,
    kv_pos_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the FINAL out and lse of the rows (not the block's own).

    With P = exp(S - lse_final) and D = rowsum(dO * O_final), dS = P * (dP - D) is exactly this block's
    share of the full softmax gradient, so blocks can be differentiated independently.
    `softcap` and `window` as in `attention_forward`.
    """
    _check(q_BHSD, k_BHSD, v_BHSD, causal_kind, q_doc_BS, kv_doc_BS, window=window, q_pos_S=q_pos_S,
           kv_pos_S=kv_pos_S)
    B, H, Sq, D = q_BHSD.shape
    Hkv, Sk = k_BHSD.shape[1], k_BHSD.shape[2]
    scale = default_scale(D) if scale is None else scale
    if Sq == 0 or Sk == 0:
        return torch.zeros_like(q_BHSD), torch.zeros_like(k_BHSD), torch.zeros_like(v_BHSD)
    band = dict(window=window, q_pos_S=q_pos_S, kv_pos_S=kv_pos_S)
    keep = block_mask(Sq, Sk, causal_kind, q_doc_BS, kv_doc_BS, q_BHSD.device, **band)
    causal = causal_kind == "causal" and keep is None
    kind = _pick_backend(backend, q_BHSD, keep is not None)
    # Rows empty everywhere: +inf makes P = exp(S - inf) = 0, so their gradient is 0, not NaN.
    lse_BHS = torch.where(lse_BHS == -math.inf, math.inf, lse_BHS).contiguous()
    dout_BHSD, out_BHSD = dout_BHSD.contiguous(), out_BHSD.contiguous()
    if kind == "reference" or softcap:
        acc = acc_dtype(q_BHSD.dtype)
        keep = block_mask(Sq, Sk, causal_kind, q_doc_BS, kv_doc_BS, q_BHSD.device, explicit=True, **band)
        grads = scores_backward(dout_BHSD.to(acc), q_BHSD.to(acc), k_BHSD.to(acc), v_BHSD.to(acc),
                                out_BHSD.to(acc), lse_BHS.to(acc), keep, scale, softcap)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q_BHSD, k_BHSD, v_BHSD)))
    if kind == "cpu_flash":
        mask = None if keep is None else _additive(keep, q_BHSD.dtype)
        return sdpa_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS.to(acc_dtype(q_BHSD.dtype)), 0.0,
            causal, attn_mask=mask, scale=scale,
        )
    lse32 = lse_BHS.float()
    dev = q_BHSD.device
    if kind == "flash":
        # Non-varlen: cumulative lengths are undefined (None); the RNG state is unused without dropout.
        seed = torch.zeros(2, dtype=torch.uint64, device=dev)
        offset = torch.zeros((), dtype=torch.uint64, device=dev)
        dq, dk, dv = sdpa_op("_scaled_dot_product_flash_attention_backward")(
            dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse32, None, None, Sq, Sk, 0.0, causal,
            seed, offset, scale=scale,
        )
        return dq, dk, dv
    k_full, v_full = expand_kv(k_BHSD, H).contiguous(), expand_kv(v_BHSD, H).contiguous()
    bias = _cuda_bias(keep, q_BHSD.dtype, H, Sq, Sk)
    seed = torch.zeros((), dtype=torch.int64, device=dev)
    offset = torch.zeros((), dtype=torch.int64, device=dev)
    if kind == "efficient":
        lse_pad = torch.zeros(B, H, -(-Sq // 32) * 32, dtype=torch.float32, device=dev)
        lse_pad[..., :Sq] = lse32
        dq, dk, dv, _ = sdpa_op("_scaled_dot_product_efficient_attention_backward")(
            dout_BHSD, q_BHSD, k_full, v_full, bias, out_BHSD, lse_pad, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale,
        )
    elif kind == "cudnn":
        dq, dk, dv = sdpa_op("_scaled_dot_product_cudnn_attention_backward")(
            dout_BHSD, q_BHSD, k_full, v_full, out_BHSD, lse32.unsqueeze(-1), seed, offset, bias,
            None, None, Sq, Sk, 0.0, causal, scale=scale,
        )
    else:  # pragma: no cover
        raise AssertionError(kind)
    return dq, reduce_kv_grad(dk, Hkv), reduce_kv_grad(dv, Hkv)


# ---------------------------------------------------------------------------------------------------
# the differentiable op


@torch.library.custom_op("meshkit::attention_block", mutates_args=())
def _attention_block_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_kind: str, scale: float,
    q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention_forward(
        q, k, v, causal_kind=causal_kind, scale=scale, q_doc_BS=q_doc, kv_doc_BS=kv_doc, backend=backend
    )
    return out.contiguous(), lse.contiguous()


@_attention_block_op.register_fake
def _(q, k, v, causal_kind, scale, q_doc, kv_doc, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, causal_kind, scale, q_doc, kv_doc, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_doc, kv_doc)
    ctx.opts = (causal_kind, scale, backend)
    ctx.set_materialize_grads(True)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, q_doc, kv_doc = ctx.saved_tensors
    causal_kind, scale, backend = ctx.opts
    dq, dk, dv = attention_backward(
        dout, q, k, v, out, lse, causal_kind=causal_kind, scale=scale, q_doc_BS=q_doc,
        kv_doc_BS=kv_doc, backend=backend,
    )
    return dq, dk, dv, None, None, None, None, None


_attention_block_op.register_autograd(_backward, setup_context=_setup_context)
# The op as the dispatcher names it: selective checkpointing keeps its output as it keeps SDPA's
ATTENTION_BLOCK_OP = torch.ops.meshkit.attention_block.default


def attention_block(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal_kind: CausalKind = "none",
    scale: float | None = None,
    q_doc_BS: torch.Tensor | None = None,
    kv_doc_BS: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable (out, lse) of one attention block; gradients flow through `out` only.

    The lse is returned for inspection and merging outside autograd; a gradient w.r.t. it is ignored.
    """
    _check(q_BHSD, k_BHSD, v_BHSD, causal_kind, q_doc_BS, kv_doc_BS, dropout_p)
    scale = default_scale(q_BHSD.shape[-1]) if scale is None else float(scale)
    return _attention_block_op(q_BHSD, k_BHSD, v_BHSD, causal_kind, scale, q_doc_BS, kv_doc_BS, backend)
