"""What an eager forward call needs per launch, kept cheap: the scratch per stream, the current
stream, and launch plans per call signature.

A short attention kernel runs for about as long as the Python that validates its inputs and packs
its parameters, so the eager ``flash_attn_func`` (and a custom spec's ``kernel(q, k, v)`` with
scalar params) remembers, per call signature (shapes, strides, dtypes, device, options, and the
kernel and its params), what a validated call computed: the kernel, the packed parameters
without the pointers, and the output shapes. A later call with that signature copies the packed
parameters, fills in this call's pointers, allocates the outputs and launches. The signature
holds everything the checks read except the data pointers, whose alignment a plan checks per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from .abi import FwdParams

_ALIGN_MASK = 15  # TMA: 16-byte aligned base pointers
_MAX_PLANS = 1024  # a program with more call signatures than this starts over (a cheap bound)

# ---------------------------------------------------------------------------------------------
# scratch and stream
# ---------------------------------------------------------------------------------------------

# A forward kernel's scratch per (device index, stream): see fwd_workspace.
_FWD_WORKSPACES: dict[tuple[int | None, int], torch.Tensor] = {}
_FWD_WORKSPACE_MIN_BYTES = 256


def fwd_workspace(nbytes: int, device: torch.device, stream: int) -> torch.Tensor | None:
    """The scratch a forward kernel asked for (the lpt scheduler's tile counter), None for 0 bytes.

    It is zeroed before its first launch and every launch leaves it zeroed (abi.h), so the
    launches queued on one stream share one, in stream order: no allocation or memset per call.
    A launch being captured into a CUDA graph gets its own, zeroed inside the graph, because the
    graph may later replay on another stream beside eager launches that use the shared one.
    """
    if nbytes == 0:
        return None
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    key = (device.index, stream)
    workspace = _FWD_WORKSPACES.get(key)
    if workspace is None or workspace.numel() < nbytes:
        # Allocated and zeroed on `stream` (the current one), so it is zero before the launch.
        workspace = torch.zeros(max(nbytes, _FWD_WORKSPACE_MIN_BYTES), dtype=torch.uint8, device=device)
        _FWD_WORKSPACES[key] = workspace
    return workspace


def attach_workspace(params: FwdParams, workspace_bytes: int, device: torch.device,
                     stream: int) -> torch.Tensor | None:
    """The scratch the kernel asked for into params.workspace (``fwd_workspace``); the caller
    keeps the returned tensor alive until the launch is queued."""
    workspace = fwd_workspace(workspace_bytes, device, stream)
    params.workspace = workspace.data_ptr() if workspace is not None else None
    return workspace


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    """The current CUDA stream of `device` as an int (cudaStream_t). torch's raw-stream query
    where this torch has it (what its compiled code calls: no Stream object per call, which costs
    a few microseconds), else the public API."""
    if _raw_stream is not None and device.index is not None:
        return int(_raw_stream(device.index))
    return torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------------------------------
# launch plans
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchPlan:
    """A validated forward call's work without its pointers: run() repeats it on new tensors of
    the same signature."""

    kernel: Any  # CompiledKernel (or a test's stand-in): .fwd(params, stream), .workspace_bytes
    params: bytes  # FwdParams with sizes, strides, scale and variant values; pointers unset
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) of the call, or None when this call needs the full path: a pointer that is
        not 16-byte aligned (whose error message the full path gives) or another current device."""
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        device = self.device
        if (q_ptr | k_ptr | v_ptr) & _ALIGN_MASK or torch.cuda.current_device() != device.index:
            return None
        out = torch.empty(self.out_shape, dtype=self.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        params = FwdParams.from_buffer_copy(self.params)
        params.q, params.k, params.v, params.o, params.lse = q_ptr, k_ptr, v_ptr, out.data_ptr(), lse.data_ptr()
        stream = current_stream(device)
        _workspace_alive = attach_workspace(params, self.kernel.workspace_bytes, device, stream)
        self.kernel.fwd(params, stream)
        return out, lse


_PLANS: dict[Hashable, LaunchPlan] = {}


def _scalar_params(params: dict[str, Any]) -> tuple[tuple[str, type, Any], ...] | None:
    """A custom spec's param values as part of a signature (with their types: 1 and 1.0 hash
    alike, and an int32 param rejects 1.0), or None when one is not a plain int or float (a
    tensor has its own checks and pointer)."""
    if any(type(value) not in (int, float) for value in params.values()):
        return None
    return tuple(sorted((name, type(value), value) for name, value in params.items()))


def plan_key(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
             alibi_slopes: Any, kernel: Any = None, params: dict[str, Any] | None = None) -> Hashable | None:
    """The call signature a plan is kept under, or None for a call that gets no plan: tensors of
    a subclass, ALiBi slopes (a tensor of their own to check), options of other types than the
    plain ones (whose conversion the full path does, errors included). A custom spec's call
    (``kernel(q, k, v, **params)``) adds its kernel and its params, scalars only."""
    if alibi_slopes is not None or not (type(q) is torch.Tensor and type(k) is torch.Tensor
                                        and type(v) is torch.Tensor):
        return None
    if type(causal) is not bool or type(softcap) not in (float, int) \
            or not (softmax_scale is None or type(softmax_scale) in (float, int)):
        return None
    # Exactly two ints: (-1.0, -1) would hash like (-1, -1) and skip the check that rejects it.
    if type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int \
            or type(window_size[1]) is not int:
        return None
    scalars = _scalar_params(params) if params else ()
    if scalars is None:
        return None
    # By identity: the plan keeps its kernel alive, so the id is not reused while the plan is kept.
    kernel_id = id(kernel) if kernel is not None else None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, softmax_scale, causal, window_size, softcap, kernel_id, scalars)


def plan_for(key: Hashable | None) -> LaunchPlan | None:
    return _PLANS.get(key) if key is not None else None


def run_planned(key: Hashable | None, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) from the plan of this signature, or None: no plan yet, or the call needs the
    full path (LaunchPlan.run)."""
    plan = plan_for(key)
    return plan.run(q, k, v) if plan is not None else None


def remember(key: Hashable | None, kernel: Any, params: FwdParams, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Keeps the plan of a call that the full path validated and launched."""
    if key is None:
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    template = FwdParams.from_buffer_copy(params)
    template.q = template.k = template.v = template.o = template.lse = template.workspace = None
    _PLANS[key] = LaunchPlan(kernel, bytes(template), tuple(out.shape), tuple(lse.shape), out.dtype, out.device)


def forget_plans() -> None:
    """Drops every plan (the kernel memo was cleared, e.g. by tests that swap fa3gen.compile)."""
    _PLANS.clear()
