"""split_tail's rule (fa3gen.split_tail.splits, rendered into the kernel's scheduler) and the
dispatcher that takes a registry kernel's split twin for the problems the rule splits."""

from __future__ import annotations

import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from fa3gen import ops, registry, render, split_tail
from fa3gen.bench import bench_cases
from fa3gen.spec import KernelSpec
from fa3gen_testing import host_cxx

SMS = 132  # H100 SXM and H200


@pytest.mark.parametrize("tiles, key_blocks, expected", [
    (176, 32, True),     # hdim 128, 192 rows: 1 x 4096 queries x 8 heads, a wave and a third
    (86, 128, True),     # one head of 16k queries: 86 of 132 SMs busy
    (32, 128, True),     # 128 queries over 16k keys, 32 heads: a quarter of the SMs
    (64, 8, False),      # shares of 4 key blocks (lost 5%)
    (352, 16, False),    # 2.7 waves: a 10% shorter busiest CTA is below the bar
    (128, 128, False),   # 128 tiles on 132 SMs: nothing to save
    (264, 64, False),    # whole waves
    (1376, 128, False),  # the FA3 grid's hdim 128 16k: its 5% tail stays whole (on this rule)
    (112, 24, False),    # a wave of 24 key blocks: 3 saved, fewer than a piece's 4 (split it lost 15%)
    (100, 16, False),    # 16 key blocks, 3 saved
    (88, 24, True),      # 24 key blocks, 8 saved
])
def test_rule(tiles, key_blocks, expected):
    assert split_tail.splits(tiles, key_blocks, SMS) is expected
    assert not split_tail.splits(tiles, key_blocks, split_tail.MAX_CTAS + 1)  # past the workspace's partials


def test_the_kernel_renders_the_rule():
    code = render(KernelSpec(head_dim=128, split_tail=True))
    assert f"constexpr int kSplitTailMaxCtas = {split_tail.MAX_CTAS};" in code
    assert f"constexpr int kSplitTailMinSavingPercent = {split_tail.MIN_SAVING_PERCENT};" in code
    assert f"constexpr int kSplitTailMinShareBlocks = {split_tail.MIN_SHARE_BLOCKS};" in code
    assert "share >= kSplitTailMinShareBlocks\n" in code
    assert f"constexpr int kSplitTailPieceBlocks = {split_tail.PIECE_BLOCKS};" in code
    assert "(whole + share + kSplitTailPieceBlocks) * 100 <= (whole + key_blocks) * (100 - kSplitTailMinSavingPercent);" in code


def test_a_spec_sets_the_rules_cost_model():
    """split_tail_min_saving_percent and split_tail_piece_blocks: rendered into the kernel's rule, in
    the kernel's name, left out of the canonical JSON at their defaults, and only with split_tail."""
    default = KernelSpec(head_dim=128, split_tail=True)
    lower = KernelSpec(head_dim=128, split_tail=True, split_tail_min_saving_percent=3, split_tail_piece_blocks=2)
    assert (default.split_tail_min_saving_percent, default.split_tail_piece_blocks) == (12, 4)
    assert "split_tail_min_saving_percent" not in default.canonical_json()
    assert "split_tail_piece_blocks" not in default.canonical_json()
    assert '"split_tail_min_saving_percent":3' in lower.canonical_json()
    assert '"split_tail_piece_blocks":2' in lower.canonical_json()
    assert KernelSpec.from_json(default.canonical_json()) == default
    assert KernelSpec.from_json(lower.canonical_json()) == lower
    code = render(lower)
    assert "constexpr int kSplitTailMinSavingPercent = 3;" in code
    assert "constexpr int kSplitTailPieceBlocks = 2;" in code
    assert f"constexpr int kSplitTailPieceBlocks = {split_tail.PIECE_BLOCKS};" in render(default)
    assert "_st3p2" in lower.name and "_st_" in default.name + "_"
    for fields in ({"split_tail_min_saving_percent": 3}, {"split_tail_piece_blocks": 2}):
        with pytest.raises(ValueError, match="need split_tail=True"):
            KernelSpec(head_dim=128, **fields)
    with pytest.raises(ValueError):
        KernelSpec(head_dim=128, split_tail=True, split_tail_min_saving_percent=100)


@pytest.mark.parametrize("tiles, key_blocks, expected", [
    (1376, 64, True),    # the FA3 grid's hdim 128 16k on 192 x 256 (e4m3): 10.4 waves, 5% shorter
    (1376, 128, True),   # and 8k or 16k on 192 x 128 (16-bit)
    (1376, 32, True),    # 8k on 192 x 256
    (1408, 32, False),   # 4k on 192 x 128: 2.8% shorter
    (112, 12, False),    # a wave of 12 key blocks: one block saved, less than a piece costs (lost 7%)
    (112, 24, False),    # three of 24 saved (lost 15%)
    (176, 32, True),     # a wave and a third
])
def test_the_low_rule(tiles, key_blocks, expected):
    assert split_tail.splits(tiles, key_blocks, SMS, 3) is expected


@pytest.mark.parametrize("name", [n for n, s in registry.REGISTRY.items() if s.split_tail])
def test_the_fa3_grid_splits_only_on_the_low_rule_twins(name):
    """The FA3-setup problems (16k tokens, hidden 2048) a twin splits: only 8k and 16k queries on
    the hdim 128 192-row twins of registry.SPLIT_TWIN_FIELDS (BENCHMARKS.md); every other
    twin leaves the grid whole, where the dispatcher keeps the plain kernels."""
    spec = registry.REGISTRY[name]
    low = spec.split_tail_min_saving_percent < split_tail.MIN_SAVING_PERCENT
    for _, s, b, h, _ in bench_cases([spec.head_dim], [512, 1024, 2048, 4096, 8192, 16384], [False]):
        tiles = -(-s // spec.block_m) * h * b
        rule = (spec.split_tail_min_saving_percent, spec.split_tail_piece_blocks)
        expected = low and s >= 8192 and spec.head_dim == 128 and spec.block_m == 192
        assert split_tail.splits(tiles, -(-s // spec.block_n), SMS, *rule) is expected, (s, b, h)


@pytest.mark.parametrize("rule", [{}, {"split_tail_min_saving_percent": 3}, {"split_tail_piece_blocks": 0}])
def test_the_kernels_rule_decides_as_the_dispatcher(tmp_path, rule):
    """The rule as rendered into the kernel's scheduler, compiled for the host, decides every
    problem of a grid as fa3gen.split_tail.splits (what the dispatcher asks) does: otherwise the
    op would take a twin that runs whole, or keep a kernel whose twin would split."""
    spec = KernelSpec(head_dim=128, split_tail=True, **rule)
    code = render(spec)
    # the rule's constants (not the workspace's, which need the kernel's tiles)
    constants = [line for line in code.splitlines() if re.match(r"constexpr int kSplitTail\w+ = \d+;", line)]
    body = code[code.index("    int const rest = num_tiles % ctas;"):code.index("    whole_tiles = split ?")]
    source = tmp_path / "rule.cpp"
    source.write_text("#include <climits>\n#include <cstdint>\n#include <cstdio>\n" + "\n".join(constants) + """
static bool kernel_splits(int num_tiles, int key_blocks, int ctas) {
""" + body + """  return split;
}
int main() {
  int tiles, key_blocks, ctas;
  while (std::scanf("%d %d %d", &tiles, &key_blocks, &ctas) == 3) {
    std::printf("%d\\n", int(kernel_splits(tiles, key_blocks, ctas)));
  }
}
""")
    subprocess.run([host_cxx("to compile the kernel's rule"), "-std=c++17", "-O1", "-o", str(tmp_path / "rule"), str(source)],
                   check=True)
    problems = [(t, k, c) for t in range(1, 3000, 7) for k in (1, 2, 3, 4, 8, 12, 16, 24, 32, 64, 128, 512, 4096)
                for c in (78, 114, 132, split_tail.MAX_CTAS, split_tail.MAX_CTAS + 1)]
    problems += [(131, 2**24, 132), (200, 2**23, 132)]  # units past the bound on 32-bit shares, and within it
    out = subprocess.run([str(tmp_path / "rule")], input="\n".join(f"{t} {k} {c}" for t, k, c in problems),
                         capture_output=True, text=True, check=True).stdout.split()
    cost = (spec.split_tail_min_saving_percent, spec.split_tail_piece_blocks)
    expected = [str(int(split_tail.splits(t, k, c, *cost))) for t, k, c in problems]
    assert 100 < expected.count("1") < len(expected) - 100  # the grid holds splits and wholes alike
    mismatches = [(p, o, e) for p, o, e in zip(problems, out, expected) if o != e]
    assert not mismatches, mismatches[:5]


def _fake_kernel(spec: KernelSpec) -> SimpleNamespace:
    return SimpleNamespace(spec=spec)


def test_the_rule_floor_is_the_laxest_twins():
    twins = [s for s in registry.REGISTRY.values() if s.split_tail]
    assert registry.SPLIT_RULE_FLOOR == (min(t.split_tail_min_saving_percent for t in twins),
                                         min(t.split_tail_piece_blocks for t in twins)) == (3, split_tail.PIECE_BLOCKS)


def test_dispatch_takes_the_twin_for_small_problems(monkeypatch):
    monkeypatch.setattr(ops, "_sm_count", lambda device: SMS)
    compiled = []
    monkeypatch.setattr(ops, "_compile_fn", lambda: lambda spec: compiled.append(spec) or _fake_kernel(spec))
    monkeypatch.setattr(ops, "_KERNELS", {})
    long = registry.REGISTRY["fwd_d128_bf16_long"]

    def pick(spec, b, sq, sk, h):
        return ops._split_twin_for(_fake_kernel(spec), b, sq, h, sk, torch.device("cuda", 0)).spec

    assert pick(long, 1, 4096, 4096, 8) == registry.REGISTRY["fwd_d128_bf16_long_split"]
    # the FA3 grid's shapes: 16k and 8k split on this twin's low rule (SPLIT_TWIN_FIELDS), 4k does not
    assert pick(long, 1, 16384, 16384, 16) == registry.REGISTRY["fwd_d128_bf16_long_split"]
    assert pick(long, 2, 8192, 8192, 16) == registry.REGISTRY["fwd_d128_bf16_long_split"]
    assert pick(long, 4, 4096, 4096, 16) == long
    assert pick(long, 1, 1216, 3072, 16) == long  # one key block saved: less than a piece costs
    assert pick(long, 2, 1024, 1024, 8) == long  # shares of 4 key blocks
    # the default rule on the other twins: hdim 256's grid stays whole
    assert pick(registry.REGISTRY["fwd_d256_bf16"], 1, 16384, 16384, 8) == registry.REGISTRY["fwd_d256_bf16"]
    short = registry.REGISTRY["fwd_d128_bf16_short"]
    assert pick(short, 4, 128, 16384, 8) == registry.REGISTRY["fwd_d128_bf16_short_split"]
    assert compiled == [registry.REGISTRY["fwd_d128_bf16_long_split"], registry.REGISTRY["fwd_d128_bf16_short_split"]]
    # causal kernels too (their twins on the static schedule): 128 queries over 16k keys, not a whole wave
    causal = registry.REGISTRY["fwd_d128_bf16_causal"]
    assert pick(causal, 4, 128, 16384, 8) == registry.REGISTRY["fwd_d128_bf16_causal_split"]
    assert registry.REGISTRY["fwd_d128_bf16_causal_split"].scheduler == "static" and causal.scheduler == "lpt"
    assert pick(causal, 1, 4096, 4096, 8) == causal  # two waves of 128-row tiles
    # ... and only below a wave of tiles, where the plain kernel's lpt schedule leaves SMs idle:
    # 192 tiles over 4096 keys, which the rule would split (18% shorter), stay on the lpt kernel
    causal_fp8 = registry.REGISTRY["fwd_d256_e4m3_causal_long"]
    assert split_tail.splits(192, 22, SMS) and pick(causal_fp8, 1, 4096, 4096, 6) == causal_fp8
    assert pick(causal_fp8, 1, 4096, 4096, 2) == registry.REGISTRY["fwd_d256_e4m3_causal_long_split"]
    # hdim 256's e4m3 128 x 192 twin on its own 35% rule: a 32% shorter busiest CTA stays whole
    long_fp8 = registry.REGISTRY["fwd_d256_e4m3_long"]
    assert split_tail.splits(64, 22, SMS) and pick(long_fp8, 1, 4096, 4096, 2) == long_fp8
    assert pick(long_fp8, 4, 128, 16384, 8) == registry.REGISTRY["fwd_d256_e4m3_long_split"]
    # variants outside the registry and twins themselves stay as they are
    for spec in (KernelSpec(head_dim=128, softcap=True), registry.REGISTRY["fwd_d128_bf16_long_split"]):
        assert pick(spec, 1, 4096, 4096, 8) == spec
    # e4m3 (fa3gen.fp8_ops's dispatch): the registry's not-causal kernels have twins too
    assert pick(registry.REGISTRY["fwd_d128_e4m3_long"], 1, 8192, 8192, 4) == registry.REGISTRY["fwd_d128_e4m3_long_split"]
