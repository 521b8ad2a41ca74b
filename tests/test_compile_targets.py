"""Every default config of both kernel families compiles for Hopper (sm_90a) and Blackwell (sm_100a) to the
MMA instruction its design says, within each GPU's shared-memory and register limits: Triton's
ahead-of-time compiler and ptxas run on the CPU (``tools/compile_defaults.py``), so a regression of what
a GPU user would run fails here, without a GPU. And the Triton releases that cannot compile them are
refused with the version to install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkernels import runtime

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compile_defaults.py"
ARCHS = (90, 100)
BLOCK_SCALED_PAIRS = ("mxfp8xmxfp8", "mxfp4xmxfp4", "mxfp8xmxfp4", "nvfp4xnvfp4")
ALL_PAIRS = ("bf16xbf16", *BLOCK_SCALED_PAIRS, "bf16xmxfp8", "bf16xmxfp4", "bf16xnvfp4")
HOPPER_LAYOUT_PAIRS = ("bf16xmxfp4@hopper", "bf16xnvfp4@hopper")  # weights in the hopper layout (hopper_kernel.py)


def _compilable(arch: int) -> bool:
    return runtime.triton_version() >= runtime.MIN_TRITON[arch // 10]


@pytest.fixture(scope="module")
def report() -> dict[int, list[str]]:
    """The tool's lines per architecture that this Triton compiles for (one run, two processes)."""
    archs = [arch for arch in ARCHS if _compilable(arch)]
    if not archs:
        return {}
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--arch",
            ",".join(map(str, archs)),
            "--jobs",
            "2",
            # fp8 blocks: a few cases of their own below (test_fp8_blocks_backends_compile), not every default here
            "--pairs",
            ",".join((*ALL_PAIRS, *HOPPER_LAYOUT_PAIRS)),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines, arch = {}, None
    for line in done.stdout.splitlines():
        header = re.fullmatch(r"## sm_(\d+)a", line)
        if header:
            arch = int(header.group(1))
            lines[arch] = []
        elif arch is not None and line.strip():
            lines[arch].append(line)
    assert set(lines) == set(archs), f"the tool stopped early:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return lines


def _need(arch: int) -> None:
    if not _compilable(arch):
        needed = ".".join(map(str, runtime.MIN_TRITON[arch // 10]))
        pytest.skip(
            f"Triton {'.'.join(map(str, runtime.triton_version()))} cannot compile the sm_{arch}a "
            f"defaults (needs {needed}); the library refuses that GPU there (test_old_triton_is_refused)"
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_every_default_config_compiles_to_its_mma_within_limits(report, arch):
    _need(arch)
    lines = report[arch]
    failing = [line for line in lines if not line.endswith(" ok")]
    assert not failing, "configs that fail to compile, miss their MMA or exceed the GPU:\n" + "\n".join(failing)
    # the walk covered both families, every format pair, decode and compute tiles, plain and SwiGLU
    matmul = [line for line in lines if line.startswith("grouped_matmul")]
    for pair in ALL_PAIRS:
        of_pair = [line for line in matmul if line.split()[1] == pair]
        assert len(of_pair) >= 6 and {"plain", "swiglu"} <= {line.split()[2] for line in of_pair}, pair
    for pair in HOPPER_LAYOUT_PAIRS:
        hopper_layout = [line for line in matmul if line.split()[1] == pair]
        assert len(hopper_layout) >= 4 and {"plain", "swiglu"} <= {line.split()[2] for line in hopper_layout}, pair
    # with the FP8 prefill and paged decode (tools/compile_attention.py) and the combine's two variants
    assert sum(line.startswith("attention") for line in lines) == 12


def test_blackwell_block_scaled_pairs_take_the_native_block_scaled_mma(report):
    _need(100)
    expected = {
        "mxfp8xmxfp8": "tcgen05.mxf8f6f4.block32",
        "mxfp8xmxfp4": "tcgen05.mxf8f6f4.block32",
        "mxfp4xmxfp4": "tcgen05.mxf4.block32",
        "nvfp4xnvfp4": "tcgen05.mxf4nvf4.block16",
    }
    for line in report[100]:
        fields = line.split()
        if fields[0] == "grouped_matmul" and fields[1] in expected:
            assert f" {expected[fields[1]]} " in line, line
            assert "dot_scaled" in fields, line
            if "swap" in fields:  # decode tiles: no register spills
                assert re.search(r" stack +0 ", line), line


def test_blackwell_attention_prefill_shows_fa4(report):
    """Two Q tiles read every K/V tile, the O rescale sits behind a branch, part of exp2 is a polynomial."""
    _need(100)
    prefill = [line for line in report[100] if line.startswith("attention") and " prefill " in line]
    assert len(prefill) == 5  # d64, d128, d256, the window, FP8 q / K / V
    for line in prefill:
        assert " tcgen05.f16 " in line and "MMAs per K/V tile 2," in line, line
        rescales, mufu, poly = map(
            int, re.search(r"conditional rescales (\d+), exp2 MUFU (\d+) / poly (\d+)", line).groups()
        )
        assert rescales > 0 and mufu > 0 and poly > 0, line


def test_hopper_attention_and_large_tiles_take_wgmma(report):
    _need(90)
    for line in report[90]:
        if line.startswith("attention") and " prefill " in line:
            assert " wgmma " in line, line
        if line.startswith("grouped_matmul") and re.search(r" 256x\d+x\d+ ", line):
            assert " wgmma " in line, line


@pytest.mark.parametrize(
    "capability, version, refused",
    [
        ((10, 0), (3, 6), True),
        ((10, 0), (3, 7), True),
        ((10, 0), (3, 8), False),
        ((10, 3), (3, 9), False),
        ((12, 0), (3, 6), True),
        ((9, 0), (3, 6), False),
        ((8, 0), (3, 6), False),
    ],
)
def test_old_triton_is_refused(capability, version, refused):
    with runtime.pretend_gpu(capability, triton_version=version) as device:
        if refused:
            with pytest.raises(
                RuntimeError, match=r"needs Triton >= 3\.8, found " + re.escape(".".join(map(str, version)))
            ):
                runtime.check_triton(device)
        else:
            runtime.check_triton(device)


def _compiler_rows(script: str) -> list[list[str]]:
    """Runs ``script`` in a subprocess without ``TRITON_INTERPRET`` (Gluon's compiler refuses the interpreter's
    helpers) and returns its printed lines, split into words."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line.split() for line in done.stdout.splitlines()]


def test_gluon_hopper_attention_compiles_to_warp_specialized_wgmma():
    """The Gluon attention for Hopper (``attention/gluon_hopper.py``: its backend's KernelSpec) builds for sm_90a with
    this Triton: wgmmas, per-sequence (3-D) TMA loads, and the consumer warpgroups raised to 240 registers (160 with
    three of them) and the load warp lowered to 24 (setmaxnreg), at every head dim, with and without the LSE output;
    the masked variants' load warp takes work tiles from an atomic counter."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    script = (
        "import re\n"
        "from llmkernels.attention.gluon_hopper import compile_for_sm90\n"
        "for d, window, lse, consumers in ((64, False, False, 3), (64, True, True, 2), (128, True, True, 2),\n"
        "                                  (256, True, False, 2)):\n"
        "    ptx = compile_for_sm90(d, window, return_lse=lse, consumers=consumers, sinks=d == 64 and window)['ptx']\n"
        "    regs = sorted(set(re.findall(r'setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)', ptx)), key=int)\n"
        "    print(d, window, ptx.count('wgmma.mma_async'), ptx.count('cp.async.bulk.tensor.3d'), ','.join(regs),\n"
        "          ptx.count('atom.global'))\n"
    )
    rows = _compiler_rows(script)
    assert len(rows) == 4
    for (head_dim, window, wgmmas, tma_loads, regs, atomics), consumers in zip(rows, (3, 2, 2, 2)):
        assert int(wgmmas) > 0 and int(tma_loads) > 0, (head_dim, window, wgmmas, tma_loads)
        # persistent: masked variants take work tiles from a counter, unmasked ones stride the grid
        assert int(atomics) == (1 if window == "True" else 0), (head_dim, window, atomics)
        assert {"24", "240" if consumers == 2 else "160"} <= set(regs.split(",")), regs


def test_gluon_hopper_attention_compiles_over_a_paged_cache_and_ragged():
    """The paged and ragged variants (chunked prefill, varlen) build for sm_90a: one TMA box per page a key tile
    spans (16-key pages: 8 per 128-key tile, for K, for V and for the zero-filled last V tile), the fence
    between the load warp's zeroing stores and the wgmmas that read the tile, and no spill in the load warp's 24
    registers."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    script = (
        "import re\n"
        "from llmkernels.attention.gluon_hopper import compile_for_sm90\n"
        "for d, window, page, ragged in ((128, True, 16, False), (256, False, 256, True), (64, True, 0, True)):\n"
        "    ptx = compile_for_sm90(d, window, return_lse=True, page_size=page, ragged=ragged)['ptx']\n"
        "    regs = sorted(set(re.findall(r'setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)', ptx)), key=int)\n"
        "    print(d, ptx.count('cp.async.bulk.tensor.3d'), ptx.count('fence.proxy.async.shared::cta'),\n"
        "          ptx.count('ld.local') + ptx.count('st.local'), ','.join(regs))\n"
    )
    rows = _compiler_rows(script)
    assert len(rows) == 3
    (_, loads_16, fences_16, spills_16, regs_16), (_, loads_256, fences_256, spills_256, _), ragged = rows
    # Q's two boxes, then 8 boxes for K, 8 for V and 8 for the V tile zero-filled past the sequence's end (LLVM
    # may duplicate the loop body: at least that many); 64-key tiles inside 256-key pages: one box each
    assert int(loads_16) >= 2 + 3 * 8 and int(loads_256) >= 2 + 3, (loads_16, loads_256)
    assert int(loads_16) > 2 * int(loads_256), (loads_16, loads_256)
    assert int(fences_16) >= 1 and int(fences_256) >= 1
    assert int(spills_16) == 0 and int(spills_256) == 0
    assert {"24", "240"} <= set(regs_16.split(",")), regs_16
    # ragged q and k (D 64, three consumers): Q's three boxes, K, V, the zero-filled V tile; no spill
    assert int(ragged[1]) >= 3 + 3 and int(ragged[2]) >= 1 and int(ragged[3]) == 0, ragged


def test_gluon_decode_split_pass_compiles():
    """The Gluon split-KV decode pass (``attention/gluon_decode.py``) builds for sm_90a: wgmmas for S and P V, TMA
    loads (one box per page a 64-key tile spans: 4 per K tile at 16-key pages), the fence before the wgmma that
    reads a V tile zeroed past the sequence (paged only), and no spill."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    script = (
        "from llmkernels.attention.gluon_decode import compile_for_sm90\n"
        "for d, page in ((128, 16), (128, 64), (64, 0)):\n"
        "    ptx = compile_for_sm90(d, page)['ptx']\n"
        "    print(d, page, ptx.count('wgmma.mma_async'), ptx.count('cp.async.bulk.tensor.3d'),\n"
        "          ptx.count('fence.proxy.async.shared::cta'), ptx.count('ld.local') + ptx.count('st.local'))\n"
    )
    rows = [[int(word) for word in row] for row in _compiler_rows(script)]
    assert len(rows) == 3
    (_, _, wgmma_16, loads_16, fences_16, spills_16), (_, _, _, loads_64, _, spills_64), dense = rows
    assert wgmma_16 > 0 and dense[2] > 0
    # K and V boxes in the prologue and the refill: 4 per tile at 16-key pages, 1 at 64 (LLVM may duplicate)
    assert loads_16 >= 4 * 4 and loads_64 >= 4 and loads_16 >= 4 * loads_64 - 4, (loads_16, loads_64)
    assert fences_16 >= 2 and spills_16 == 0 and spills_64 == 0 and dense[5] == 0, rows


_FP8_SCRIPT = """
import os, re, subprocess, sys, tempfile
sys.path.insert(0, {tools!r})
import compile_common  # noqa: F401 - sets TRITON_INTERPRET=0 and the path to src first
import triton
from compile_grouped_matmul import described_call, on_gpu
from triton.backends.compiler import GPUTarget
from llmkernels.grouped_matmul.backends import backend_for
from llmkernels.grouped_matmul.plan import launch_configs

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_of(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([CUOBJDUMP, "-sass", file.name], capture_output=True, text=True, check=True).stdout


def mma_loops(sass):
    # (code, loops): the SASS as (address, text), and the MMA loops: a backward branch and its target with an MMA
    # between them and no other backward branch (not an outer loop, nor the jump back from a wait's retry code placed
    # after the end)
    lines = re.findall(r"/\\*([0-9a-f]{{4,}})\\*/\\s+([^;]*);", sass)
    code = [(int(address, 16), text) for address, text in lines]
    back = []
    for address, text in code:
        target = re.search(r"\\bBRA\\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            back.append((int(target.group(1), 16), address))
    loops = [
        (start, end)
        for start, end in back
        if any(("GMMA" in t or "UTC" in t) for a, t in code if start <= a <= end)
        and not any(start <= other < end for _, other in back)
    ]
    return code, loops


def loop_spills(sass):
    # spill instructions (STL / LDL) in the MMA loops
    code, loops = mma_loops(sass)
    spills = [t for a, t in code if any(s <= a <= e for s, e in loops) and re.search(r"\\b(STL|LDL)\\b", t)]
    return len(spills) if loops else -1


cases = (
    (90, 2048, "fp8_hopper", "fp8xfp8"),
    (90, 8, "fp8_blocks", "fp8xfp8"),
    (100, 2048, "fp8_blocks", "fp8xfp8"),
    (90, 2048, "bf16_hopper", "bf16xbf16"),
)
for arch, tokens, wanted, pair in cases:
    with on_gpu(arch) as device:
        call = described_call(pair, tokens, False, device)
        config, low, high = launch_configs(call, None)[0]
        backend = backend_for(call, config)
        spec = backend.kernel_spec(call, config, (low, high))
    compiled = triton.compile(spec.ast_source(), target=GPUTarget("cuda", arch, 32), options=dict(spec.options))
    ptx = compiled.asm["ptx"]
    kinds = sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m\\d+n\\d+k\\d+\\.(\\w+\\.\\w+\\.\\w+)", ptx)))
    kinds += sorted(set(re.findall(r"tcgen05\\.mma\\.cta_group::\\d\\.kind::(\\w+)", ptx)))
    regs = sorted(set(re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)), key=int)
    spills = loop_spills(sass_of(compiled.asm["cubin"])) if arch == 90 else 0
    print(arch, tokens, backend.__name__.rsplit(".", 1)[-1], wanted, ",".join(kinds) or "-", ",".join(regs) or "-",
          compiled.metadata.shared, spills)
"""


def test_warp_specialized_and_fp8_blocks_backends_compile():
    """FP8 blocks (``fp8xfp8``, each backend's default launch as the library plans it) build for their GPUs: on
    sm_90a the Gluon ``fp8_hopper`` kernel (compute-size groups) and the portable ``fp8_blocks`` kernel (decode,
    swap-AB) issue only e4m3 x e4m3 wgmmas (QGMMA) with no spill inside a loop that issues them, the Gluon kernel
    warp-specialized (setmaxnreg: consumers 232, load warp 40); on sm_100a the portable kernel issues tcgen05
    ``kind::f8f6f4``; all within a block's shared memory (232448 bytes). The same Gluon kernel on bf16 operands
    (``bf16_hopper``, compute-size groups) issues only bf16 wgmmas, warp-specialized the same way."""
    if not (_compilable(90) and _compilable(100)):
        pytest.skip("this Triton does not compile for sm_90a and sm_100a")
    rows = _compiler_rows(_FP8_SCRIPT.format(tools=str(TOOL.parent)))
    assert len(rows) == 4, rows
    for arch, tokens, backend, wanted, kinds, regs, shared, spills in rows:
        assert backend == wanted, (arch, tokens, backend)
        assert int(shared) <= 232448, (arch, tokens, shared)
        if backend == "bf16_hopper":
            assert kinds == "f32.bf16.bf16", kinds
            assert int(spills) == 0, spills
        elif arch == "90":
            assert kinds == "f32.e4m3.e4m3", (tokens, kinds)
            assert int(spills) == 0, (tokens, spills)  # -1: no MMA loop found
        else:
            assert kinds == "f8f6f4", kinds
        if backend in ("fp8_hopper", "bf16_hopper"):
            assert {"232", "40"} <= set(regs.split(",")), regs


_FP8_ATTENTION_SCRIPT = (
    _FP8_SCRIPT.split("cases = (")[0]  # its SASS helpers: sass_of, mma_loops, loop_spills
    + """
from llmkernels.attention.gluon_fp8_prefill import compile_for_sm90


def loop_stack_traffic(sass):
    # (STL in the MMA loops, most LDL in one of them)
    code, loops = mma_loops(sass)
    if not loops:
        return -1, -1
    stores = sum(1 for a, t in code if any(s <= a <= e for s, e in loops) and re.search(r"\\bSTL\\b", t))
    loads = max(sum(1 for a, t in code if s <= a <= e and re.search(r"\\bLDL\\b", t)) for s, e in loops)
    return stores, loads


cases = (
    (64, False, {{}}),
    (128, False, dict(ragged=True)),
    (128, True, dict(return_lse=True)),
    (256, True, {{}}),
    (128, True, dict(fp8_q=False, page_size=16, sinks=True)),
    (128, False, dict(seqlen_q=128)),
)
for d, causal, options in cases:
    asm = compile_for_sm90(d, causal, **options)
    ptx = asm["ptx"]
    kinds = sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.(m\\d+n\\d+k\\d+\\.\\w+\\.\\w+\\.\\w+)", ptx)))
    regs = sorted(set(re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)), key=int)
    stores, loads = loop_stack_traffic(sass_of(asm["cubin"]))
    transposes = ptx.count("fence.proxy.async")  # the producer's V transpose ends in one
    print(d, causal, ",".join(kinds), ",".join(regs), stores, loads, ptx.count("atom.global"), transposes)
"""
)


def test_gluon_fp8_attention_compiles_to_e4m3_wgmma():
    """The Gluon FP8 prefill (``attention/gluon_fp8_prefill.py``: its backend's KernelSpec) builds for sm_90a at D 64
    (full), 128 (ragged full; causal with the LSE; a bf16 q quantized per row over a paged cache, causal; 128 queries
    full) and 256 (causal): only e4m3 x e4m3 wgmmas (``m64n{TILE_N}k32`` for S = Q K^T, 128 keys a tile or 64 at D 256,
    ``m64n{D}k32`` for P V: no bf16 MMA), consumers raised to 240 registers and the producer lowered to 24
    (setmaxnreg), no spill stored inside a loop that issues them and at most two reloads in one (ptxas keeps a
    lane-index value and a phase bit of the ragged / paged / windowed kernel on the stack at 240 registers: one or two
    L1 loads per ~860-instruction loop body, at D 128; none at D 64 and 256), and causal work tiles from an atomic
    counter. Dense K/V read by 16 work tiles per KV head or more (the 4096-query cases) take V transposed in memory
    (no transpose in the producer, no proxy fence); ragged, paged and the 128-query call keep the producer's."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    rows = _compiler_rows(_FP8_ATTENTION_SCRIPT.format(tools=str(TOOL.parent)))
    assert [int(row[-1]) > 0 for row in rows] == [False, True, False, False, True, True], rows
    for head_dim, causal, kinds, regs, stores, loads, atomics, _ in rows:
        tile_n = 64 if head_dim == "256" else 128
        assert set(kinds.split(",")) == {f"m64n{tile_n}k32.f32.e4m3.e4m3", f"m64n{head_dim}k32.f32.e4m3.e4m3"}, kinds
        assert {"24", "240"} <= set(regs.split(",")), regs
        assert int(stores) == 0 and 0 <= int(loads) <= 2, (head_dim, causal, stores, loads)  # -1: no MMA loop
        assert int(atomics) == (1 if causal == "True" else 0), (head_dim, causal, atomics)


def test_fp8_hopper_binds_tma_descriptors_over_the_plan_tensors():
    """What the ``fp8_hopper`` backend binds for a GPU launch, checked without one (under the interpreter a binding
    compiles nothing): the plan's tensors, handed by the kernel's ``*_ptr`` names, reach it as TMA descriptors over
    A ``[T, K]`` (64 x 128 boxes) and B ``[E·N, K]`` (128 x 128) and out ``[T, N_out]`` for the TMA store, the
    scalars in the kernel's order; a B whose experts are not back to back is copied per call and an out TMA cannot
    address is stored without TMA."""
    import llmkernels as lk
    from llmkernels.grouped_matmul.backends import TENSORS, fp8_hopper
    from llmkernels.grouped_matmul.check import check_grouped_matmul, operand_tensors

    if not runtime.interpreting():
        pytest.skip("binds under the interpreter (on a GPU the binding compiles the kernel)")
    tokens, experts, n, k = 70, 3, 192, 320
    a = lk.quantize(torch.randn(tokens, k), "fp8", block=(1, 128))
    b = lk.quantize(torch.randn(experts, n, k), "fp8", block=(128, 128))
    offsets = torch.tensor([0, 30, 70], dtype=torch.int32)
    ids = torch.tensor([2, -1], dtype=torch.int32)
    out = torch.empty(tokens, n, dtype=torch.bfloat16)
    call = check_grouped_matmul(a, b, offsets, ids, None, None, torch.bfloat16, out, None)
    config = lk.BlockScaledMatmulConfig(128, 256, 128)
    spec = fp8_hopper.kernel_spec(call, config, (-1, 2**31 - 1))
    (a_data, a_scales, _), (b_data, b_scales, _) = operand_tensors(a), operand_tensors(b)
    tensors = dict(zip(TENSORS, (a_data, a_scales, offsets, b_data, b_scales, offsets, out, offsets, offsets, ids)))
    tensors.update(expert_scales=offsets, bias=offsets)
    pointers = [name[: -len("_ptr")] for name in spec.fn.arg_names if name.endswith("_ptr")]
    assert pointers == ["a", "a_scales", "b", "b_scales", "out", "a_offsets", "expert_ids", "expert_scales", "bias"]

    def bind(**changed):
        values = {**tensors, **changed}
        scalars = fp8_hopper.scalars(call, config, (-1, 2**31 - 1), values)
        return spec.bind(*(values[name] for name in pointers), *scalars)

    launch = bind()
    bound = launch.bound
    assert bound.names[:11] == (*(f"{name}_ptr" for name in pointers), "out_desc", "tile_counter")
    assert bound.slots == tuple(range(11))  # every tensor and descriptor is passed per call, the tile counter too
    boxes = {
        bound.names[i]: (t.fields["shape"], t.fields["strides"], t.fields["block_shape"])
        for i, t in bound.templates.items()
    }
    assert boxes == {
        "a_ptr": ([tokens, k], [k, 1], [64, 128]),
        "b_ptr": ([experts * n, k], [k, 1], [128, 128]),
        "out_desc": ([tokens, n], [n, 1], [64, 128]),
    }
    sizes = dict(zip(bound.names, bound.values))
    assert (sizes["num_tokens"], sizes["N"], sizes["N_out"], sizes["K"], sizes["n_tiles"]) == (tokens, n, n, k, 1)
    assert sizes["TMA_STORE"] and not launch.copy_a and not launch.copy_b
    # experts 16 rows apart in memory, out 2 bytes off 16-byte alignment
    spaced = torch.zeros(experts, n + 16, k, dtype=torch.uint8)[:, :n]
    spaced.copy_(b_data)
    shifted = torch.empty(tokens, n + 8, dtype=torch.bfloat16)[:, 1 : n + 1]
    launch = bind(b=spaced, out=shifted)
    assert launch.copy_b and not launch.copy_a
    assert dict(zip(launch.bound.names, launch.bound.values))["TMA_STORE"] is False


def test_bf16_hopper_binds_tma_descriptors_over_the_plan_tensors():
    """The ``bf16_hopper`` backend's binding, checked without a GPU: TMA descriptors over bf16 A ``[T, K]`` (64 x 64
    boxes: one 128-byte row of K) and B ``[E·N, K]`` (128 x 64), the pointer-store epilogue (the out descriptor is
    a dummy it never reads), the scale strides 0; a B whose experts are not back to back is copied per call."""
    import llmkernels as lk
    from llmkernels.grouped_matmul.backends import TENSORS, bf16_hopper
    from llmkernels.grouped_matmul.check import check_grouped_matmul

    if not runtime.interpreting():
        pytest.skip("binds under the interpreter (on a GPU the binding compiles the kernel)")
    tokens, experts, n, k = 70, 3, 192, 320
    a = torch.randn(tokens, k, dtype=torch.bfloat16)
    b = torch.randn(experts, n, k, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 30, 70], dtype=torch.int32)
    ids = torch.tensor([2, -1], dtype=torch.int32)
    out = torch.empty(tokens, n, dtype=torch.bfloat16)
    call = check_grouped_matmul(a, b, offsets, ids, None, None, torch.bfloat16, out, None)
    config = lk.BlockScaledMatmulConfig(128, 256, 64)
    spec = bf16_hopper.kernel_spec(call, config, (-1, 2**31 - 1))
    tensors = dict(zip(TENSORS, (a, offsets, offsets, b, offsets, offsets, out, offsets, offsets, ids)))
    tensors.update(expert_scales=offsets, bias=offsets)
    pointers = [name[: -len("_ptr")] for name in spec.fn.arg_names if name.endswith("_ptr")]

    def bind(**changed):
        values = {**tensors, **changed}
        scalars = bf16_hopper.scalars(call, config, (-1, 2**31 - 1), values)
        return spec.bind(*(values[name] for name in pointers), *scalars)

    launch = bind()
    bound = launch.bound
    boxes = {
        bound.names[i]: (t.fields["shape"], t.fields["strides"], t.fields["block_shape"])
        for i, t in bound.templates.items()
    }
    assert boxes == {
        "a_ptr": ([tokens, k], [k, 1], [64, 64]),
        "b_ptr": ([experts * n, k], [k, 1], [128, 64]),
        "out_desc": ([64, 128], [128, 1], [64, 128]),
    }
    sizes = dict(zip(bound.names, bound.values))
    assert (sizes["num_tokens"], sizes["N"], sizes["N_out"], sizes["K"], sizes["n_tiles"]) == (tokens, n, n, k, 1)
    assert sizes["STAGES"] == 4 and sizes["TMA_STORE"] is False and not launch.copy_a and not launch.copy_b
    spaced = torch.zeros(experts, n + 16, k, dtype=torch.bfloat16)[:, :n]
    spaced.copy_(b)
    assert bind(b=spaced).copy_b


_W4A8_SCRIPT = (
    "import dataclasses\n"
    + _FP8_SCRIPT.split("cases = (")[0]
    + "cases = ("
    + '(90, 2048, "w4a8_hopper", "fp8xmxfp4"),)\n'
    + "for arch"
    + _FP8_SCRIPT.split("\nfor arch", 1)[1].replace(
        "call = described_call(pair, tokens, False, device)",
        "call = dataclasses.replace(described_call(pair, tokens, False, device), has_expert_scales=False)",
    )
)


def test_w4a8_backends_compile_for_sm90():
    """fp8 (1, 128) activations with MXFP4 weights (``fp8xmxfp4``, the default launch as the library plans it) build
    for sm_90a: the Gluon ``w4a8_hopper`` kernel (compute-size groups, plain epilogue) issues only e4m3 x e4m3
    wgmmas, warp-specialized (setmaxnreg: consumers 232, load warp 40), no spill inside a loop that issues them,
    within a block's shared memory. The decode sizes: :func:`test_w4a8_decode_backend_compiles_for_sm90`."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    rows = _compiler_rows(_W4A8_SCRIPT.format(tools=str(TOOL.parent)))
    assert len(rows) == 1, rows
    for arch, tokens, backend, wanted, kinds, regs, shared, spills in rows:
        assert backend == wanted, (arch, tokens, backend)
        assert int(spills) == 0, (tokens, spills)  # -1: no MMA loop found
        assert int(shared) <= 232448, (tokens, shared)
        assert kinds == "f32.e4m3.e4m3", kinds
        assert {"232", "40"} <= set(regs.split(",")), regs


_W4A8_DECODE_SCRIPT = """
import sys
sys.path.insert(0, {tools!r})
import compile_common  # noqa: F401 - sets TRITON_INTERPRET=0 and the path to src first
from compile_common import Case, expected_mma
from compile_defaults import compile_case, problems
from compile_grouped_matmul import described_call, on_gpu
from llmkernels.grouped_matmul.backends import backend_for, w4a8_blocks
from llmkernels.grouped_matmul.plan import launch_configs

for tokens, swiglu in ((8, False), (8, True), (48, True)):  # 48 tokens plain: the Gluon w4a8_hopper kernel
    with on_gpu(90) as device:
        call = described_call("fp8xmxfp4", tokens, swiglu, device)
        config, low, high = next(launch for launch in launch_configs(call, None) if launch[1] < tokens <= launch[2])
        backend = backend_for(call, config)
        # the launch's kernel, and the portable kernel it runs where the weights have no Hopper-layout copy
        specs = ((backend.__name__.rsplit(".", 1)[-1], backend.kernel_spec(call, config, (low, high))),
                 ("fallback", w4a8_blocks.kernel_spec(call, config, (low, high))))
    for name, spec in specs:
        source = spec.ast_source()
        c = spec.constexprs
        mma_m = c["BLOCK_N"] if name != "fallback" or config.ab_swapped else c["BLOCK_M"]
        case = Case("grouped_matmul", name, spec.fn, source.signature, dict(c), source.attrs,
                    spec.options["num_warps"], spec.options["num_stages"], mma_m, expected_mma(90, mma_m))
        result = compile_case(case, 90)
        found = problems(case, result, 90) or ["ok"]
        print(tokens, "swiglu" if swiglu else "plain", name, c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"],
              c.get("A_FP8_BLOCKS", "-"), result.mma, result.hgmma, result.hgmma_waits, result.hgmma_hazards,
              result.stack, "|".join(found).replace(" ", "_"))
"""


def test_w4a8_decode_backend_compiles_for_sm90():
    """fp8 (1, 128) activations with MXFP4 weights in the decode sizes (8 tokens per group, plain and SwiGLU; 48 under
    SwiGLU: the plain 17-64-token class takes the Gluon ``w4a8_hopper`` kernel), the default launches as the library
    plans them on sm_90, take the ``w4a8_decode`` backend: the Hopper-layout kernel in its fp8 mode on the
    Hopper-layout path's tiles (16 tokens x 128 weight rows, 64 under SwiGLU; 64 tokens x 64 rows; K steps of 128) builds for sm_90a to wgmma with no register spill, no write to the A registers of an HGMMA in flight
    (``tools/sass_hazards.py``), no wgmma serialized by ptxas, within the GPU's limits (``tools/compile_defaults.py``'s
    checks); so does the portable ``w4a8_blocks`` kernel each launch falls back to without a copy."""
    if not _compilable(90):
        pytest.skip("this Triton does not compile for sm_90a")
    rows = _compiler_rows(_W4A8_DECODE_SCRIPT.format(tools=str(TOOL.parent)))
    assert len(rows) == 6, rows
    for (
        tokens,
        epilogue,
        backend,
        block_m,
        block_n,
        block_k,
        fp8_mode,
        mma,
        hgmma,
        waits,
        hazards,
        stack,
        found,
    ) in rows:
        assert found == "ok", (tokens, epilogue, backend, found)
        assert int(hazards) == 0 and int(stack) == 0, (tokens, epilogue, backend, hazards, stack)
        assert mma == "wgmma" and int(hgmma) > 0, (tokens, epilogue, backend, mma, hgmma)
        assert int(waits) <= 2 or 2 * int(waits) < int(hgmma), (tokens, epilogue, backend, waits, hgmma)  # serialized
        if backend != "fallback":
            assert backend == "w4a8_decode" and fp8_mode == "True", (tokens, backend, fp8_mode)
            expected = (16, 64 if epilogue == "swiglu" else 128, 128) if tokens == "8" else (64, 64, 128)
            assert (int(block_m), int(block_n), int(block_k)) == expected, (tokens, epilogue, block_m, block_n)


def test_exchange_kernels_compile():
    """The expert-parallel exchange's plan and row gather (``routing/exchange.py``) build for sm_90a and sm_100a
    (the interpreter runs them on the CPU but does not check what only the compiler does, such as loop-carried
    types), and the gather moves 16-byte vectors when its rows and pointers are aligned."""
    archs = [arch for arch in ARCHS if _compilable(arch)]
    if not archs:
        pytest.skip("this Triton compiles for neither target")
    script = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from llmkernels.routing.exchange import _gather_rows_kernel, _plan_exchange_kernel\n"
        "plan = {'expert_ids_ptr': '*i64', 'weights_ptr': '*fp32', 'own_ids_ptr': '*i32', 'token_ptr': '*i64',\n"
        "        'sent_ids_ptr': '*i32', 'sent_weights_ptr': '*fp32', 'rows_ptr': '*i64', 'weights_table_ptr': '*fp32',\n"
        "        'counts_ptr': '*i64', 'num_tokens': 'i32', 'bound': 'i32', 'row_offset': 'i32', 'sent_row_words': 'i32'}\n"
        "gather = {'src_ptr': '*i32', 'index_ptr': '*i64', 'count_ptr': '*i32', 'out_ptr': '*i32', 'src_stride': 'i32'}\n"
        "aligned = {(i,): [['tt.divisibility', 16]] for i in range(5)}\n"
        f"for arch in {archs}:\n"
        "    target = GPUTarget('cuda', arch, 32)\n"
        "    for world, k in ((2, 8), (3, 6)):\n"
        "        const = dict(RANK=1, WORLD=world, PER_RANK=32, K=k, BLOCK_T=1024, BLOCK_K=triton.next_power_of_2(k),\n"
        "                     BLOCK_W=triton.next_power_of_2(world))\n"
        "        source = ASTSource(_plan_exchange_kernel, {**plan, **dict.fromkeys(const, 'constexpr')}, const)\n"
        "        triton.compile(source, target=target, options={'num_warps': 8})\n"
        "    const = dict(WORDS=3584, BLOCK_R=4, BLOCK_W=1024)\n"
        "    source = ASTSource(_gather_rows_kernel, {**gather, **dict.fromkeys(const, 'constexpr')}, const, aligned)\n"
        "    ptx = triton.compile(source, target=target, options={'num_warps': 4}).asm['ptx']\n"
        "    print(arch, ptx.count('ld.global.v4'), ptx.count('st.global.v4'))\n"
    )
    rows = _compiler_rows(script)
    assert [int(row[0]) for row in rows] == archs
    assert all(int(loads) > 0 and int(stores) > 0 for _, loads, stores in rows), rows
