"""The kernel variants' names and generated sources, and the plans that name them (CPU only)."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest
import torch

from groupgrad.kernels import quantize_fp8, tuning

_DTYPES = {
    "fprop": [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    "dgrad": [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    "wgrad": [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
    ],
}


@pytest.mark.parametrize("op", sorted(_DTYPES))
def test_every_plan_names_a_default_variant(op: str) -> None:
    compiled = {v.name for v in tuning.VARIANTS}
    for (din, dout), (T, E), (N, K) in itertools.product(
        _DTYPES[op], [(32768, 8), (32768, 128), (100, 3)], [(4096, 1024), (1024, 4096)]
    ):
        plan = tuning.plan_for(op, din, dout, T, E, N, K)
        assert plan.variant in compiled, (op, din, dout, T, E, N, K)


def test_an_explicit_epilogue_subtile_reaches_the_template_and_the_name() -> None:
    auto = tuning.Variant("wgrad", "bf16", "f32", "pong", (128, 128, 64), (1, 2))
    wide = tuning.Variant("wgrad", "bf16", "f32", "pong", (128, 128, 64), (1, 2), epilogue_n=64)
    assert auto.name == "wgrad_bf16_f32_pong_128x128x64_c1x2"  # the default set's names stay
    assert wide.name == "wgrad_bf16_f32_pong_128x128x64_c1x2_e64"
    assert "128, 128, 64, 1, 2, 0>" in auto.translation_unit()  # 0: CUTLASS chooses
    assert "128, 128, 64, 1, 2, 64>" in wide.translation_unit()
    assert wide.name in wide.translation_unit()


def test_the_fp8_mainloop_choice_reaches_the_template_and_the_name() -> None:
    from groupgrad.kernels.build import Fp8Variant

    overlapped, cutlass = Fp8Variant("fprop", "bf16"), Fp8Variant("fprop", "bf16", overlap=False)
    # the config's (..., Pingpong, Overlap, tile M, N, K, cluster M, N)
    assert "false, true, 128, 128, 128, 1, 2>" in overlapped.translation_unit()
    assert "false, false, 128, 128, 128, 1, 2>" in cutlass.translation_unit()
    assert overlapped.name == "fp8_fprop_bf16_coop_ovl_128x128x128_c1x2"
    assert cutlass.name == "fp8_fprop_bf16_coop_128x128x128_c1x2"
    # what every build ships: the overlapped mainloop, but for the reduce-add wgrad
    shipped = [v for v in tuning.VARIANT_SETS["default"] if isinstance(v, Fp8Variant)]
    assert [v.name for v in shipped if not v.overlap] == ["fp8_wgrad_f32_add_coop_128x128x128_c1x2"]


def _cuda_struct(source: str, name: str) -> str:
    """The text of ``struct name`` in a CUDA header, up to its closing ``};``."""
    start = source.index(f"struct {name} ")
    return source[start : source.index("\n};\n", start)]


def test_both_fp8_mainloops_clear_the_accumulator_before_the_first_promotion() -> None:
    # CUTLASS's blockwise mainloop adds every promoted block to `accum`, the first included,
    # and never zeroes it; on the GPU the kernels were right only because the compiler folded
    # the undefined addend, so no GPU comparison can tell a missing clear. The sources must.
    from groupgrad.kernels import build

    csrc = pathlib.Path(build.__file__).parent / "csrc"
    gemm = " ".join((csrc / "fp8_gemm.cuh").read_text().split())
    assert (
        "std::conditional_t<Config::kOverlap, OverlappedPromotionMainloop<BuiltMainloop>, "
        "ClearedAccumulatorMainloop<BuiltMainloop>>;" in gemm
    )
    mainloops = (csrc / "fp8_overlap_mainloop.cuh").read_text()
    cleared = _cuda_struct(mainloops, "ClearedAccumulatorMainloop")
    assert "clear(accum);" in cleared
    assert cleared.index("clear(accum);") < cleared.index("Cutlass::mma(")
    overlapped = _cuda_struct(mainloops, "OverlappedPromotionMainloop")
    mma = overlapped[overlapped.index(" mma(") :]
    assert "clear(accum);" in mma
    first_promotion = re.search(r"promote(<\d+>)?\(accum", mma)
    assert first_promotion is not None
    assert mma.index("clear(accum);") < first_promotion.start()


def test_the_fp32_fp8_wgrad_accumulates_by_reduce_add_and_overwrites_through_c() -> None:
    from groupgrad.kernels import _cutlass  # the threshold

    default = {v.name: v for v in tuning.VARIANT_SETS["default"]}
    many = _cutlass.ADD_FROM_TOKENS_PER_EXPERT
    adding = default[
        tuning.fp8_variant_for("wgrad", torch.float32, accumulate=True, tokens_per_expert=many)
    ]
    storing = default[
        tuning.fp8_variant_for("wgrad", torch.float32, accumulate=False, tokens_per_expert=many)
    ]
    # few tokens per expert: L2's read-modify-write is slower than the epilogue's load of C
    few = tuning.fp8_variant_for(
        "wgrad", torch.float32, accumulate=True, tokens_per_expert=many - 1
    )
    assert few == storing.name
    assert adding.adds
    assert not adding.has_source
    assert "<float, false, true, " in adding.translation_unit()
    assert not storing.adds
    assert storing.has_source
    assert "<float, true, false, " in storing.translation_unit()
    # a bf16 reduce-add would round the product to bf16 before adding: never compiled
    bf16 = default[
        tuning.fp8_variant_for("wgrad", torch.bfloat16, accumulate=True, tokens_per_expert=many)
    ]
    assert not bf16.adds
    assert bf16.has_source
    with pytest.raises(ValueError, match="only the fp32 wgrad adds"):
        type(adding)("wgrad", "bf16", adds=True)
    with pytest.raises(ValueError, match="only the fp32 wgrad adds"):
        type(adding)("fprop", "f32", adds=True)


def test_the_fp8_wgrad_counts_the_experts_of_packed_and_listed_outputs(monkeypatch) -> None:
    from groupgrad.kernels import _cutlass

    ran: list[str] = []

    class Extension:
        def fp8_wgrad(self, *args: object) -> None:
            ran.append(str(args[10]))  # the variant's name

    monkeypatch.setattr(_cutlass, "_extension", lambda variant: Extension())
    adds = {v.name: v.adds for v in tuning.VARIANT_SETS["default"] if v.name.startswith("fp8_")}
    t = torch.empty(0)
    packed, listed = [torch.empty(128, 128, 128)], [torch.empty(128, 128)] * 128
    for out in (packed, listed):
        _cutlass.fp8_wgrad(t, t, t, t, t, t, t, 128 * 256, out, True)  # 256 tokens per expert
        _cutlass.fp8_wgrad(t, t, t, t, t, t, t, 128 * 2048, out, True)
    assert [adds[name] for name in ran] == [False, True, False, True]


def test_an_fp8_launch_rejects_a_swizzle_the_scheduler_has_not() -> None:
    x8 = quantize_fp8(torch.ones(4, 128), block=(1, 128))
    w8 = quantize_fp8(torch.ones(1, 128, 128), block=(128, 128))
    with pytest.raises(ValueError, match=r"max_swizzle is 3, expected 1, 2, 4 or 8"):
        tuning.run_fp8_cutlass(
            "fprop", x8, w8, torch.tensor([4]), torch.empty(4, 128), variant="v", max_swizzle=3
        )


def test_the_build_compiles_every_hand_written_source_and_binds_every_launch() -> None:
    """Each ``.cu``/``.cpp`` in csrc is compiled (a file left out links without its kernels
    until an import fails on the GPU), and every launcher the bindings call is defined."""
    from groupgrad.kernels import build

    on_disk = {p.name for p in build.CSRC_DIR.iterdir() if p.suffix in {".cu", ".cpp"}}
    assert set(build.SOURCES) == on_disk
    bindings = "".join((build.CSRC_DIR / n).read_text() for n in build.SOURCES if n.endswith("cpp"))
    launched = set(re.findall(r"\b(launch_\w+)\(", bindings))
    defined = "".join((build.CSRC_DIR / n).read_text() for n in build.SOURCES if n.endswith(".cu"))
    assert launched, "the reader found no launcher"
    for name in launched:
        assert re.search(rf"cudaError_t {name}\(", defined), f"{name} is not defined in a .cu file"


def test_variant_names_are_unique_across_the_sets() -> None:
    names = [v.name for v in tuning.VARIANTS + tuning.TUNING_VARIANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("swizzle", [0, 3, 16, True, 2.0])
def test_a_plan_rejects_a_swizzle_the_scheduler_has_not(swizzle: object) -> None:
    with pytest.raises(ValueError, match=r"max_swizzle is .*, expected 1, 2, 4 or 8"):
        tuning.Plan("fprop_bf16_bf16_coop_128x256x64_c1x1", max_swizzle=swizzle)  # type: ignore[arg-type]


def test_a_plan_takes_every_swizzle_the_scheduler_has() -> None:
    for swizzle in (1, 2, 4, 8):
        assert tuning.Plan("v", True, swizzle).max_swizzle == swizzle


@pytest.mark.parametrize(
    ("splits", "message"),
    [
        (
            torch.tensor([4, 4], dtype=torch.int32),
            "int64 tensor of token counts, got dtype torch.int32",
        ),
        (
            torch.tensor([[4, 4]]),
            r"1-D int64 tensor of token counts, got dtype torch.int64, shape \(1, 2\)",
        ),
        (
            torch.tensor([4, 0, 4, 0])[::2],
            r"contiguous 1-D int64 tensor of token counts, got .*strides \(2,\)",
        ),
        ([4, 4], "int64 tensor of token counts, got list"),
        (torch.tensor([4, 4], device="meta"), "splits is on meta, expected cpu"),
    ],
)
def test_run_cutlass_rejects_splits_the_kernels_cannot_read(splits: object, message: str) -> None:
    x, w, y = torch.zeros(8, 16), torch.zeros(2, 8, 16), torch.zeros(8, 8)
    with pytest.raises(ValueError, match=message):
        tuning.run_cutlass("fprop", x, w, splits, y)  # type: ignore[arg-type]
    assert not y.any()  # nothing written


def test_run_cutlass_rejects_an_unknown_op() -> None:
    x = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="op is 'fprp', expected"):
        tuning.run_cutlass("fprp", x, x, torch.tensor([8]), x)  # type: ignore[arg-type]
