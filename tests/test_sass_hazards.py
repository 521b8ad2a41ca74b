"""``tools/sass_hazards.py`` finds writes to the A registers of an HGMMA in flight, in straight code and
around a loop, and only those: hand-written SASS in ``cuobjdump``'s format."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import sass_hazards  # noqa: E402


def _sass(*lines: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;   /* 0x0 */" for i, line in enumerate(lines))


LOOP = (
    "LDS.128 R152, [R2+0x100]",  # 0x00 the loop head: next A fragments
    "LDS.128 R156, [R2+0x200]",  # 0x10
    "WARPGROUP.ARRIVE",  # 0x20
    "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24, gsb0",  # 0x30
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # 0x40
    "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR8], R24, gsb0",  # 0x50
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # 0x60 the second stays in flight
    "IADD3 R2, R2, 0x400, RZ",  # 0x70
    "@!P0 BRA 0x0",  # 0x80
)


def test_a_register_written_in_the_next_iteration_is_found():
    found = sass_hazards.hazards(_sass(*LOOP))
    assert [(h.address, h.hgmma_address, h.around_loop) for h in found] == [(0x10, 0x50, True)]
    assert "R156" in found[0].write


def test_a_full_wait_before_the_branch_clears_it():
    fixed = list(LOOP)
    fixed[6] = "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert sass_hazards.hazards(_sass(*fixed)) == []


def test_straight_code_shared_operands_and_other_registers():
    sass = _sass(
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24, gsb0",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",  # A in shared memory: no registers
        "IMAD.WIDE R154, R3, 0x4, R4",  # writes R154-R155: in flight
        "STS.128 [R152], R8",  # reads R152: not a write
        "SHFL.IDX PT, R153, R9, R1, R0",  # writes R153
        "MOV R160, R1",  # not an A register
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "MOV R152, R1",  # retired
    )
    assert [h.address for h in sass_hazards.hazards(sass)] == [0x20, 0x40]


def test_groups_close_at_gsb0():
    sass = _sass(
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24",  # joins the next group
        "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR8], R24, gsb0",
        "HGMMA.64x128x16.F32.BF16 R24, R160, gdesc[UR12], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # retires the first group (two HGMMAs)
        "MOV R152, RZ",
        "MOV R157, RZ",
        "MOV R163, RZ",  # the last group is in flight
    )
    assert [h.address for h in sass_hazards.hazards(sass)] == [0x60]
