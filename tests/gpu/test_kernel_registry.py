"""The kernel registry and the CPU path's isolation from CUDA. These run everywhere (no GPU);
the NVRTC checks run wherever cuda-python and NVRTC are installed, GPU or not."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atlas.adapters.cuda.registry import (
    KernelRegistryError,
    KernelTarget,
    arch_family,
    describe,
    kernels_root,
    nvrtc_arch,
    select_modules,
)

EXPECTED_MODULES = {
    "attention_decode", "attention_prefill", "elementwise", "fp8_quantize", "gemv", "gemv_fp8", "norm", "rope_cache",
    "sampling",
}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_shipped_tree_has_every_generic_module_and_headers():
    modules = select_modules(KernelTarget("sm90", "llama", "bf16"))
    assert set(modules) >= EXPECTED_MODULES
    for module in modules.values():
        text = module.source_path.read_text()
        assert text.startswith("//"), f"{module.source_path} must open with its header comment"
        assert module.include_dirs[-1] == kernels_root() / "common"


# Kernels that read before waiting only what the previous kernel does not write (weights; step
# inputs, the cascade's shared prefix among them; the RoPE table, decode attention's earlier
# tokens' K/V; the residual row whose RMS RoPE and act_mul_rms take after the product that reads
# it; the MoE slot table, which the routing wrote two kernels before moe_down): their impl calls
# dependent_launch_entry() itself once those loads are issued. moe_ring_silu initialises its
# ring's barriers first and waits with grid_dependency_wait(), launching its dependents only after
# its grid barrier.
_WAIT_INSIDE = {
    "gemv.cu": ("gemv_impl<", "gemv_mma_impl<", "skinny_impl<"),
    "attention_decode.cu": ("attention_decode_impl<", "attention_decode_mma_impl<", "attention_cascade_impl<"),
    "rope_cache.cu": ("rope_and_cache_impl<",),
    "elementwise.cu": ("act_mul_rms_vec8<",),
    "gemv_fp8.cu": ("gemv_fp8_impl<", "gemv_fp8_mma_impl<"),
    "fp8_quantize.cu": ("quantize_token_impl<", "quantize_group_impl<"),
    "moe.cuh": ("moe_route_small_impl(", "moe_down_impl("),
    "moe.cu": ("moe_ring_silu_impl(",),  # sm90: its barriers' set-up, then the wait (the grid barrier's reason)
    "gated_delta.cu": ("causal_conv1d_impl(", "gated_delta_rule_impl<"),
}


def test_every_kernel_waits_for_the_previous_grid_first():
    """Kernels are launched with programmatic stream serialization (PDL), so each must call
    dependent_launch_entry() (atlas_common.cuh) before it touches memory the previous kernel may
    write: as its first statement, or (the GEMVs) right after loading weights."""
    kernels = 0
    for source in sorted(kernels_root().rglob("*.cu*")):
        text = source.read_text()
        for match in re.finditer(r'extern "C" __global__[^{;]*\{', text):
            first_statement = text[match.end() :].lstrip(" \\\n").split(";", 1)[0].strip()
            signature = " ".join(match.group(0).split())[:100]
            waits_inside = first_statement.startswith(_WAIT_INSIDE.get(source.name, ()))
            assert first_statement == "dependent_launch_entry()" or waits_inside, f"{source.name}: {signature}"
            kernels += 1
    assert kernels >= 22
    gemv = (kernels_root() / "common/gemv.cu").read_text()
    for impl in ("void gemv_impl(", "void gemv_mma_impl("):
        body = gemv[gemv.index(impl) :]
        body = body[: body.index("\n}\n")]
        before_wait = body[: body.index("dependent_launch_entry();")]
        assert "load_x(" not in before_wait and "load_streaming_early(" in before_wait
    fp8 = (kernels_root() / "common/gemv_fp8.cu").read_text()
    body = fp8[fp8.index("void gemv_fp8_impl(") :]
    body = body[body.index("int k = threadIdx.x * FP8_LOAD;") :]  # past the `accumulate` lambda's definition
    before_wait = body[: body.index("dependent_launch_entry();")]
    # the one-row FP8 GEMV: its first steps of weights before the wait, no x (read by `accumulate`)
    assert "load_streaming_early(" in before_wait and "accumulate(" not in before_wait
    body = gemv[gemv.index("void skinny_impl(") :]
    before_wait, producer_after, _ = body.split("grid_dependency_wait();", 2)
    # the skinny GEMM's producer: only weight stages before its wait, x (the previous kernel's
    # output) after; the consumers wait (the second wait) before the epilogues read the residual
    assert "load_weights(i, i);" in before_wait and "load_x(" not in before_wait
    assert "for (int i = 0; i < early; ++i) load_x(i, i);" in producer_after
    assert "skinny_store<" not in before_wait + producer_after
    decode = (kernels_root() / "common/attention_decode.cu").read_text()
    body = decode[decode.index("void attention_decode_impl(") :]
    before_wait = body[: body.index("dependent_launch_entry();")]
    # q (the previous kernel's output) after the wait; the ring's copies stop short of the newest token
    assert "load8(q" not in before_wait and "issue_step(step, step)" in before_wait
    assert "key < ring_end ? key : ring_end - 1" in before_wait
    body = decode[decode.index("void attention_decode_mma_impl(") :]
    before_wait = body[: body.index("dependent_launch_entry();")]
    # the tensor-core kernel: the same, its copies zero-filling the newest token's row
    assert "q + q_row" not in before_wait and "if (j < my_tiles) issue_tile(j);" in before_wait
    assert "const bool valid = key >= lo && key < newest;" in before_wait
    rope = (kernels_root() / "common/rope_cache.cu").read_text()
    body = rope[rope.index("void rope_and_cache_impl(") :]
    before_wait = body[: body.index("grid_dependency_wait();")]
    # qkv (the product's output) after the wait; the residual row it multiplied, for the RMS, before;
    # decode attention may launch at once (it reads early only what neither kernel writes)
    assert "qkv +" not in before_wait and "block_inverse_rms(rms_source +" in before_wait
    assert before_wait.index("grid_dependents_launch();") < before_wait.index("positions[token]")
    elementwise = (kernels_root() / "common/elementwise.cu").read_text()
    body = elementwise[elementwise.index("void act_mul_rms_vec8(") :]
    before_wait = body[: body.index("dependent_launch_entry();")]
    assert "load(row" not in before_wait and "block_inverse_rms(rms_source +" in before_wait
    recurrent = (kernels_root() / "common/gated_delta.cu").read_text()
    # the recurrent kernels: their slot's state before the wait, the kernel before's output after
    # (the conv's mixed q, k, v; the input projection's `projected`)
    body = recurrent[recurrent.index("void gated_delta_rule_impl(") :]
    before_wait = body[body.index(") {") : body.index("dependent_launch_entry();")]
    assert "head_state[" in before_wait and "mixed" not in before_wait and "projected" not in before_wait
    body = recurrent[recurrent.index("void causal_conv1d_impl(") :]
    before_wait = body[body.index(") {") : body.index("dependent_launch_entry();")]
    assert "state[" in before_wait and "projected" not in before_wait


def test_hopper_takes_the_wgmma_prefill_module_which_keeps_every_generic_kernel():
    hopper = select_modules(KernelTarget("sm90", "llama"))["attention_prefill"]
    assert hopper.folder == "sm90"
    assert '#include "attention_prefill_mma.cuh"' in hopper.source_path.read_text()
    assert '#include "attention_prefill_mma.cuh"' in (kernels_root() / "common/attention_prefill.cu").read_text()
    assert select_modules(KernelTarget("sm80", "llama"))["attention_prefill"].folder == "common"
    assert select_modules(KernelTarget("sm120", "llama"))["attention_prefill"].folder == "common"


def test_features_follow_the_device_and_the_environment(monkeypatch):
    pytest.importorskip("cuda.core", reason="the cuda extra is not installed")
    from atlas.adapters.cuda.runtime import CudaFeatures

    monkeypatch.delenv("ATLAS_CUDA_DISABLE", raising=False)
    before_hopper = CudaFeatures.for_device((8, 0))
    assert not before_hopper.programmatic_launch and not before_hopper.launch_order_edges
    monkeypatch.setenv("ATLAS_CUDA_DISABLE", "wgmma, gemm_tuning")
    features = CudaFeatures.for_device((9, 0))
    assert not features.wgmma_attention and not features.gemm_tuning
    monkeypatch.setenv("ATLAS_CUDA_DISABLE", "pdl")
    without_pdl = CudaFeatures.for_device((9, 0))
    assert not without_pdl.programmatic_launch and not without_pdl.launch_order_edges  # it needs PDL
    monkeypatch.setenv("ATLAS_CUDA_DISABLE", "launch_order")
    assert not CudaFeatures.for_device((9, 0)).launch_order_edges
    monkeypatch.setenv("ATLAS_CUDA_DISABLE", "pdll")
    with pytest.raises(ValueError, match="pdll"):
        CudaFeatures.for_device((9, 0))


def test_most_specific_folder_wins_by_module_name(tmp_path):
    root = _tree(
        tmp_path,
        {
            "common/gemv.cu": "// generic\n",
            "common/norm.cu": "// generic\n",
            "sm90/KERNELS.toml": '[[kernel]]\nname = "gemv"\n',
            "sm90/gemv.cu": "// hopper\n",
            "sm90/llama/KERNELS.toml": '[[kernel]]\nname = "gemv"\nnote = "llama shapes"\n',
            "sm90/llama/gemv.cu": "// hopper llama\n",
            "any/llama/bf16/KERNELS.toml": '[[kernel]]\nname = "norm"\nsource = "fused_norm.cu"\n'
            "defines = { ROWS = 4 }\noptions = { max_register_count = 64 }\n",
            "any/llama/bf16/fused_norm.cu": "// llama norm\n",
            "sm80/llama/bf16/KERNELS.toml": '[[kernel]]\nname = "norm"\n',
            "sm80/llama/bf16/norm.cu": "// ampere\n",
        },
    )
    hopper_llama = select_modules(KernelTarget("sm90", "llama", "bf16"), root)
    assert hopper_llama["gemv"].folder == "sm90/llama"
    assert hopper_llama["gemv"].specificity == 6
    assert "llama shapes" in describe(hopper_llama["gemv"])
    assert hopper_llama["norm"].source_path.name == "fused_norm.cu"
    assert hopper_llama["norm"].defines == (("ROWS", "4"),)
    assert hopper_llama["norm"].options == (("max_register_count", 64),)

    hopper_qwen = select_modules(KernelTarget("sm90", "qwen3", "bf16"), root)
    assert hopper_qwen["gemv"].folder == "sm90"
    assert hopper_qwen["norm"].folder == "common"

    ampere_llama_fp8 = select_modules(KernelTarget("sm80", "llama", "fp8"), root)
    assert ampere_llama_fp8["gemv"].folder == "common"
    assert ampere_llama_fp8["norm"].folder == "common"  # both llama folders are bf16-only
    assert select_modules(KernelTarget("sm80", "llama", "bf16"), root)["norm"].folder == "sm80/llama/bf16"


def test_quant_mismatch_excludes_a_folder(tmp_path):
    root = _tree(
        tmp_path,
        {
            "common/gemv.cu": "// generic\n",
            "any/any/fp8/KERNELS.toml": '[[kernel]]\nname = "gemv"\n',
            "any/any/fp8/gemv.cu": "// fp8\n",
        },
    )
    assert select_modules(KernelTarget("sm90", "llama", "bf16"), root)["gemv"].folder == "common"
    assert select_modules(KernelTarget("sm90", "llama", "fp8"), root)["gemv"].folder == "any/any/fp8"


def test_malformed_manifests_are_named(tmp_path):
    _tree(tmp_path, {"common/gemv.cu": "//\n", "sm90/KERNELS.toml": '[[kernel]]\nname = "gemv"\n'})
    with pytest.raises(KernelRegistryError, match="gemv.cu, which does not exist"):
        select_modules(KernelTarget("sm90", "llama"), tmp_path)
    (tmp_path / "sm90/KERNELS.toml").write_text("[[kernel]\n")
    with pytest.raises(KernelRegistryError, match="KERNELS.toml"):
        select_modules(KernelTarget("sm90", "llama"), tmp_path)


def test_arch_names():
    assert arch_family((9, 0)) == "sm90" and nvrtc_arch((9, 0)) == "sm_90a"
    assert arch_family((8, 0)) == "sm80" and nvrtc_arch((8, 6)) == "sm_86"
    assert nvrtc_arch((12, 0)) == "sm_120"


def test_cpu_path_never_imports_cuda_python():
    """The package, the mock backend and backend selection import no CUDA library."""
    code = textwrap.dedent(
        """
        import sys
        import atlas.adapters.cuda as cuda_adapter
        import atlas.adapters.mock.backend
        import atlas.ports.gpu
        from atlas.adapters.cuda.registry import KernelTarget, select_modules
        select_modules(KernelTarget("sm90", "llama"))
        loaded = sorted(m for m in sys.modules if m == "cuda" or m.startswith(("cuda.", "nvmath", "nccl")))
        print(",".join(loaded))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_available_is_false_without_the_cuda_extra(monkeypatch):
    import importlib.util

    import atlas.adapters.cuda as cuda_adapter

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.split(".")[0] in {"cuda", "nvmath"} else real_find_spec(name, *a),
    )
    assert cuda_adapter.available() is False


# -- NVRTC (no GPU needed) --------------------------------------------------------------------


def _compiler(arch: str, cache_dir: Path):
    pytest.importorskip("cuda.core", reason="the cuda extra is not installed")
    from atlas.adapters.cuda.compiler import KernelCompileError, KernelCompiler

    try:
        compiler = KernelCompiler(arch, cache_dir)
        compiler._nvrtc_version()  # NVRTC loads lazily: check it is usable here, now
        compiler._include_dir()
        return compiler
    except (KernelCompileError, RuntimeError, OSError) as error:
        pytest.skip(f"NVRTC is not usable here: {error}")
    except Exception as error:  # cuda.pathfinder raises its own not-found errors
        pytest.skip(f"NVRTC is not usable here: {error}")


@pytest.mark.slow
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (12, 0)])
def test_every_kernel_compiles_and_the_second_start_hits_the_cache(tmp_path, capability):
    arch = nvrtc_arch(capability)
    compiler = _compiler(arch, tmp_path)
    modules = select_modules(KernelTarget(arch_family(capability), "llama"))
    for module in modules.values():
        assert compiler.cubin(module)[:4] == b"\x7fELF"
    assert sorted(compiler.stats.compiled) == sorted(modules)
    warm = _compiler(arch, tmp_path)
    for module in modules.values():
        warm.cubin(module)
    assert warm.stats.compiled == [] and sorted(warm.stats.loaded_from_cache) == sorted(modules)


def test_compile_error_names_the_kernel_and_shows_the_log(tmp_path):
    compiler = _compiler("sm_90a", tmp_path / "cache")
    from atlas.adapters.cuda.compiler import KernelCompileError

    root = _tree(
        tmp_path / "kernels", {"common/broken.cu": '// broken\nextern "C" __global__ void k() { undefined_name; }\n'}
    )
    module = select_modules(KernelTarget("sm90", "llama"), root)["broken"]
    with pytest.raises(KernelCompileError) as raised:
        compiler.cubin(module)
    message = str(raised.value)
    assert "broken.cu" in message and "undefined_name" in message and "sm_90a" in message


def test_cache_key_changes_with_a_header(tmp_path):
    compiler = _compiler("sm_90a", tmp_path / "cache")
    root = _tree(tmp_path / "kernels", {"common/k.cu": '// k\n#include "h.cuh"\n', "common/h.cuh": "#define A 1\n"})
    module = select_modules(KernelTarget("sm90", "llama"), root)["k"]
    before = compiler.cache_key(module)
    (root / "common/h.cuh").write_text("#define A 2\n")
    assert compiler.cache_key(module) != before


def test_skinny_plan_gives_every_sm_the_same_bytes():
    """The Llama-3.1-8B decode projections at 64 tokens on 132 SMs (32 clusters of 4 at once):
    qkv, o and down split K over clusters of 4 in tiles that leave 4 SMs idle; gate_up's 128
    tiles of 112 features take one block each; the LM head's 501 tiles run on persistent blocks.
    A cluster plan never exceeds what the GPU holds at once."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from atlas.adapters.cuda.ops_dense import SkinnyPlan, skinny_plan

    def blocks(width: int, splits: int) -> int:
        return 128 if splits == 4 else 132

    assert skinny_plan(6144, False, 4096, 132, blocks) == SkinnyPlan(192, 4, 32, 128)
    assert skinny_plan(4096, False, 4096, 132, blocks) == SkinnyPlan(128, 4, 32, 128)
    assert skinny_plan(4096, False, 14336, 132, blocks) == SkinnyPlan(128, 4, 32, 128)
    assert skinny_plan(14336, True, 4096, 132, blocks) == SkinnyPlan(224, 1, 128, 128)
    assert skinny_plan(128256, False, 4096, 132, blocks) == SkinnyPlan(256, 1, 501, 132)
    # fewer clusters of 4 at once: split in two instead
    assert skinny_plan(6144, False, 4096, 132, lambda w, s: 64 if s == 4 else 132).splits == 2
    # K too short to split
    assert skinny_plan(4096, False, 128, 132, blocks).splits == 1


def test_decode_attention_fills_one_wave_with_the_roomiest_shape():
    """Head dim 128 on 132 SMs with 228 KB each (one (8, 2) or two (4, 3) blocks per SM): batches
    up to one block per SM take (8, 2) and split up to one wave; those that fill more than half
    of (4, 3)'s wave take it unsplit, and so do more blocks than a wave holds (the default). The
    SIMT kernel still splits to two waves."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from atlas.adapters.cuda.ops_attention import decode_mma_shape, decode_split_count

    smem = 228 * 1024
    by_batch = {batch: decode_mma_shape(128, batch * 8, 132, smem) for batch in (1, 8, 16, 17, 33, 34, 128)}
    assert by_batch == {
        **{batch: (8, 2, 1) for batch in (1, 8, 16)},  # up to 132 blocks
        **{batch: (4, 3, 2) for batch in (17, 33, 34, 128)},  # 136 .. 264, and more than a wave
    }
    assert decode_mma_shape(64, 8, 132, smem) == (4, 3, 4)  # the only shape of head dim 64
    # sm_120 (99 KB a block, 100 KB an SM): (8, 2)'s 128 KB never launch there
    assert decode_mma_shape(128, 8, 132, 100 * 1024, max_shared_per_block=99 * 1024) == (4, 3, 1)
    with pytest.raises(ValueError, match="mma_decode"):
        decode_mma_shape(256, 8, 132, 100 * 1024, max_shared_per_block=32 * 1024)
    # one wave: batch 1's 8 blocks split 8 ways (64-token splits of 512), batch 8's 64 blocks 2 ways
    assert [decode_split_count(132, b, 512, 1, 64, waves=1) for b in (8, 64, 128, 132)] == [8, 2, 1, 1]
    assert decode_split_count(132, 8, 100_000, 1, 64, waves=1) == 16
    assert decode_split_count(132, 64, 100_000, 2, 128) == 8  # SIMT: two waves


def test_kernel_parameters_pack_as_the_kernel_declares_them():
    """Launches that take tensor maps build their own `void**` array (tma.py): addresses as 8
    bytes, numpy scalars at their width, a tensor map as its 128 bytes, anything else refused."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    import ctypes

    import numpy as np

    from atlas.adapters.cuda.tma import TensorMap, parameter_array

    raw = bytes(range(128))
    pointers, values = parameter_array((0x7F0000001000, np.int32(-3), np.float32(0.5), TensorMap(raw)))
    assert [ctypes.sizeof(v) for v in values] == [8, 4, 4, 128]
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x7F0000001000
    assert ctypes.c_int32.from_address(pointers[1]).value == -3
    assert ctypes.c_float.from_address(pointers[2]).value == 0.5
    assert ctypes.string_at(pointers[3], 128) == raw
    with pytest.raises(TypeError, match="float"):
        parameter_array((0.5,))
