"""One grouped linear for all local experts: y[rows of e] = x[rows of e] @ w[e]^T.

Rows of `x_TK` are sorted by expert (megatron-core's dispatchers hand them over that way)
and `counts_E` says how many belong to each. Kernels, picked by `resolve_impl`:
- "grouped_mm": torch's grouped GEMM (CUTLASS on sm90+ in bf16; torch >= 2.13 also runs it on
  CPU, where "auto" takes it: at the mini model's 128 experts an SFT step 583 -> 534 ms, the
  same loss to 4 digits, docs/experts.md),
- "npu": torch_npu's grouped matmul (Ascend), forward and both backward GEMMs,
- "loop": one matmul per expert (older GPUs, fp32 on GPU, a torch without the CPU kernel).
Weights are [E, N, K] like nn.Linear's per expert, so each expert's slice is the weight a
SequentialMLP expert holds; the kernels read its transpose as a view, never a copy.
"""

from functools import cache

import torch

IMPLS = ("auto", "grouped_mm", "npu", "loop")


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """The kernel 'auto' means for this input: grouped_mm on sm90+ bf16 and on a CPU whose torch
    runs it for x's dtype, npu on Ascend, else loop."""
    if impl not in IMPLS:
        raise ValueError(f"unknown grouped GEMM {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if x.device.type == "npu":
        return "npu"
    if x.device.type == "cpu":
        return "grouped_mm" if cpu_grouped_mm_runs(x.dtype) else "loop"
    if (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    ):
        return "grouped_mm"
    return "loop"


@cache
def cpu_grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Whether this torch has a CPU grouped GEMM for `dtype` (torch 2.13 has; the npu sets'
    older torch has none, or a CUDA-only one that refuses CPU tensors)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x_TK, w_ENK = torch.ones(2, 4, dtype=dtype), torch.ones(2, 3, 4, dtype=dtype)
    try:
        y_TN = torch._grouped_mm(x_TK, w_ENK.transpose(1, 2), offs=torch.tensor([1, 2]).int())
    except (RuntimeError, NotImplementedError):
        return False
    return bool((y_TN == 4).all())


def grouped_linear(
    x_TK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """[T, K] rows grouped by expert -> [T, N]; counts_E sums to T."""
    kind = resolve_impl(impl, x_TK)
    if x_TK.shape[0] == 0:
        # no token reached these experts (EP): plain matmuls still give their weights a grad
        kind = "loop"
    if kind == "grouped_mm":
        return _torch_grouped_mm(x_TK, w_ENK, counts_E)
    if kind == "npu":
        return _NpuGroupedLinear.apply(x_TK, w_ENK, counts_E)
    return _loop(x_TK, w_ENK, counts_E)


def _loop(x_TK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    # unbind, not w_ENK[e]: each index's backward writes its grad into a zero [E, N, K]
    # tensor (E of them per pass); unbind's backward stacks once. At 128 experts the pass
    # took 3-7x less time (bit-identical outputs and gradients).
    chunks = x_TK.split(counts_E.tolist())
    return torch.cat(
        [chunk @ w_NK.t() for chunk, w_NK in zip(chunks, w_ENK.unbind(0), strict=True)]
    )


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _torch_grouped_mm(
    x_TK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    offsets_E = counts_E.to(device=x_TK.device).cumsum(0, dtype=torch.int32)
    y_TN = torch._grouped_mm(x_TK, w_ENK.transpose(1, 2), offs=offsets_E)
    if y_TN.requires_grad:
        # its backward rejects broadcast (stride-0) gradients, e.g. from a plain .sum()
        y_TN.register_hook(_contiguous_grad)
    return y_TN


class _NpuGroupedLinear(torch.autograd.Function):
    """torch_npu.npu_grouped_matmul with its two backward GEMMs (dx: m-grouped, dw: k-grouped)."""

    @staticmethod
    def forward(ctx, x_TK, w_ENK, counts_E):
        import torch_npu

        counts = counts_E.to(device=x_TK.device, dtype=torch.int64)
        ctx.save_for_backward(x_TK, w_ENK, counts)
        # group_list_type=1: counts per group; split_item=3: one output tensor
        (y_TN,) = torch_npu.npu_grouped_matmul(
            [x_TK],
            [w_ENK.transpose(1, 2)],
            group_list=counts,
            group_type=0,
            group_list_type=1,
            split_item=3,
        )
        return y_TN

    @staticmethod
    def backward(ctx, grad_TN):
        import torch_npu

        x_TK, w_ENK, counts = ctx.saved_tensors
        grad_TN = grad_TN.contiguous()
        (dx_TK,) = torch_npu.npu_grouped_matmul(
            [grad_TN], [w_ENK], group_list=counts, group_type=0, group_list_type=1, split_item=3
        )
        # group_type=2 splits the reduction axis (tokens): one [N, K] block per expert
        (dw_ENK,) = torch_npu.npu_grouped_matmul(
            [grad_TN.t()], [x_TK], group_list=counts, group_type=2, group_list_type=1, split_item=3
        )
        return dx_TK, dw_ENK.view_as(w_ENK), None
