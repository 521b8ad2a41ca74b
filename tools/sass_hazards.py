"""Find writes to the register operand of an HGMMA that may still be in flight, in Hopper SASS.

PTX makes it undefined to touch the registers that hold a ``wgmma.mma_async``'s A fragment before a
``wgmma.wait_group`` has retired it. Triton's pipeliner leaves ``n - 1`` of a loop iteration's ``n``
wgmmas in flight into the next iteration (triton-lang/triton#9433), where the next tile's decode writes
its fragments; ptxas 12.x may give those fresh values the registers of an HGMMA still reading, and the
product then depends on timing (results differ from run to run). This scans the SASS ``cuobjdump -sass``
prints, in program order and once more around every loop (the wrap into the next iteration), keeping the
HGMMA groups a ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves pending, and reports each write to one of their A
registers. Straight-line approximation: forward branches inside a loop are read as one path.

    python tools/sass_hazards.py kernel.cubin      # prints the hazards, exits 1 when there are some
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_REGISTER = re.compile(r"^R(\d+)$")
# Mnemonics whose first register operand is read, not written.
_NO_DESTINATION = (
    "ST",
    "STS",
    "STG",
    "STL",
    "LDGSTS",
    "RED",
    "BAR",
    "BRA",
    "WARPGROUP",
    "DEPBAR",
    "MEMBAR",
    "ISETP",
    "FSETP",
    "HSETP2",
    "DSETP",
    "PLOP3",
    "EXIT",
    "RET",
    "CALL",
    "SYNCS",
    "UTMALDG",
    "UTMASTG",
    "FENCE",
    "ERRBAR",
    "CCTL",
    "NOP",
    "LDGDEPBAR",
    "ARRIVES",
    "BSYNC",
    "BSSY",
    "R2UR",
)


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str  # without the predicate
    mnemonic: str
    operands: tuple[str, ...]


@dataclass(frozen=True)
class Hazard:
    """``write`` (at ``address``) overwrites an A register of the HGMMA at ``hgmma_address``."""

    address: int
    write: str
    hgmma_address: int
    hgmma: str
    around_loop: bool

    def __str__(self) -> str:
        where = " (next loop iteration)" if self.around_loop else ""
        return f"{self.address:#06x} {self.write}  overwrites A of  {self.hgmma_address:#06x} {self.hgmma}{where}"


def parse(sass: str) -> list[Instruction]:
    instructions = []
    for match in _LINE.finditer(sass):
        text = re.sub(r"^@!?U?P\w+\s+", "", match.group(2))
        mnemonic, _, rest = text.partition(" ")
        operands = tuple(op.strip() for op in rest.split(",")) if rest else ()
        instructions.append(Instruction(int(match.group(1), 16), text, mnemonic, operands))
    return instructions


def _width(mnemonic: str) -> int:
    parts = mnemonic.split(".")
    if "128" in parts:
        return 4
    if "64" in parts or "WIDE" in parts:
        return 2
    return 1


def written_registers(instruction: Instruction) -> set[int]:
    """The general registers an instruction writes (its destination operand)."""
    base = instruction.mnemonic.split(".")[0]
    if base in _NO_DESTINATION or base == "HGMMA" or not instruction.operands:
        return set()
    operands = instruction.operands
    if base == "SHFL":  # SHFL.IDX PT, Rd, ...: a predicate first
        operands = operands[1:]
    match = _REGISTER.match(operands[0]) if operands else None
    if not match:
        return set()
    first = int(match.group(1))
    return set(range(first, first + _width(instruction.mnemonic)))


def hgmma_a_registers(instruction: Instruction) -> set[int]:
    """The four registers of an HGMMA's A fragment, or none when A comes from shared memory."""
    match = _REGISTER.match(instruction.operands[1]) if len(instruction.operands) > 1 else None
    return set(range(int(match.group(1)), int(match.group(1)) + 4)) if match else set()


class _Pending:
    """HGMMA groups not yet retired: a group closes at an HGMMA marked ``gsb0``."""

    def __init__(self):
        self.groups: list[list[Instruction]] = []
        self.open: list[Instruction] = []

    def copy(self) -> _Pending:
        other = _Pending()
        other.groups, other.open = [list(g) for g in self.groups], list(self.open)
        return other

    def step(self, instruction: Instruction, around_loop: bool, found: list[Hazard]) -> None:
        if instruction.mnemonic.startswith("HGMMA"):
            self.open.append(instruction)
            if "gsb0" in instruction.operands:
                self.groups.append(self.open)
                self.open = []
            return
        if instruction.mnemonic.startswith("WARPGROUP.DEPBAR"):
            keep = int(instruction.operands[-1], 0)
            self.groups = self.groups[len(self.groups) - keep :] if keep else []
            return
        written = written_registers(instruction)
        for group in self.groups:
            for hgmma in group:
                if written & hgmma_a_registers(hgmma):
                    found.append(Hazard(instruction.address, instruction.text, hgmma.address, hgmma.text, around_loop))


def hazards(sass: str) -> list[Hazard]:
    """Writes to the A registers of HGMMAs that may be in flight, in program order and around each loop."""
    instructions = parse(sass)
    index = {inst.address: i for i, inst in enumerate(instructions)}
    found: list[Hazard] = []
    pending = _Pending()
    state_at: dict[int, _Pending] = {}
    for i, instruction in enumerate(instructions):
        pending.step(instruction, False, found)
        state_at[i] = pending.copy()
    for end, instruction in enumerate(instructions):  # loops: a branch back to an earlier address
        if instruction.mnemonic != "BRA":
            continue
        target = int(instruction.operands[0], 16)
        if target >= instruction.address or target not in index:
            continue
        wrapped = state_at[end].copy()
        for inner in instructions[index[target] : end + 1]:
            wrapped.step(inner, True, found)
    unique = {(h.address, h.hgmma_address): h for h in found}
    return sorted(unique.values(), key=lambda h: (h.address, h.hgmma_address))


def cubin_sass(cubin: bytes, cuobjdump: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True).stdout


def main() -> int:
    import os

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    status = 0
    for path in sys.argv[1:]:
        with open(path, "rb") as file:
            data = file.read()
        sass = data.decode() if path.endswith(".sass") else cubin_sass(data, cuobjdump)
        found = hazards(sass)
        print(f"{path}: {len(found)} register-operand hazards")
        for hazard in found:
            print("  ", hazard)
        status |= bool(found)
    return status


if __name__ == "__main__":
    sys.exit(main())
