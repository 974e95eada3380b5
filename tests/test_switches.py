"""Every combination of the schedule switches that the spec allows renders into the kernel it names.

(A sample of them is compiled for real in test_compile_real.py.)
"""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from fa3gen import KernelSpec, render
from fa3gen.spec import SUPPORTED_HEAD_DIMS

COMBOS = list(itertools.product(SUPPORTED_HEAD_DIMS, (False, True), (False, True), (False, True),
                                ("grid", "static", "lpt")))


@pytest.mark.parametrize("head_dim, causal, pingpong, overlap, scheduler", COMBOS)
def test_switch_combination_renders_its_schedule(head_dim, causal, pingpong, overlap, scheduler):
    fields = dict(head_dim=head_dim, causal=causal, pingpong=pingpong, intra_wg_overlap=overlap,
                  scheduler=scheduler)
    if pingpong and KernelSpec(head_dim=head_dim).num_consumer_warpgroups != 2:
        with pytest.raises(ValidationError, match="pingpong needs num_consumer_warpgroups=2"):
            KernelSpec(**fields)
        return
    spec = KernelSpec(**fields)
    src = render(spec)
    assert spec.canonical_json() in src
    # Each switch shows up as the code it selects, and only then.
    assert ("NamedBarrier::sync(kMmaThreads, kTurnBarrier + warpgroup)" in src) == pingpong
    assert ("warpgroup_wait<1>();" in src) == overlap
    assert ("return tile + int(gridDim.x);" in src) == (scheduler == "static")
    assert ("atomicAdd(p.tile_counter, 1)" in src) == (scheduler == "lpt")
    assert ("handoff.receive()" in src) == (scheduler == "lpt")
    assert ("constexpr int kWorkspaceBytes = 16;" in src) == (scheduler == "lpt")
    assert ("crosses_right_edge" in src) == causal  # the causal diagonal (no window here)
    assert ("tma_store_arrive();" in src) == (spec.epilogue == "tma")


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_epilogue_switch_renders_its_store(head_dim):
    """O goes through a TMA store where its staging tile fits in shared memory, else from registers."""
    direct = render(KernelSpec(head_dim=head_dim, epilogue="direct"))
    assert "tma_store_arrive();" not in direct and "SmemLayoutO" not in direct
    spec = KernelSpec(head_dim=head_dim)
    assert spec.epilogue == ("tma" if head_dim <= 128 else "direct")  # d192/d256: Q, K, V fill the SM
    if spec.epilogue == "direct":
        with pytest.raises(ValidationError, match="use epilogue='direct'"):
            KernelSpec(head_dim=head_dim, epilogue="tma")
    else:
        assert "tma_store_arrive();" in render(spec)
