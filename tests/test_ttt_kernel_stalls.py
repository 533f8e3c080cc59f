"""benchmarks/ttt_kernel_stalls.py's reading of ncu's exported source page (the part that runs without a GPU): the
instructions' SASS and stall samples, and the samples by the waiting instruction's opcode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ttt_kernel_stalls as stalls  # noqa: E402

PAGE = '''"Kernel Name","_reverse_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"
"0x7f00","      LDG.E.128 R32, desc[UR4][R32.64]","2","2","0","0"
"0x7f10","      STS.128 [R0+0x2000], R48","7","1","6","6"
"0x7f20","@!P1  STS [R242], R56","1","0","1","1"
"0x7f30","      HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8], R24","0","-","0","0"
'''


def test_source_page_and_opcodes(tmp_path):
    path = tmp_path / "reverse_train.source.csv"
    path.write_text(PAGE)
    page = stalls.source_page(path)
    assert set(page) == {0x7F00, 0x7F10, 0x7F20, 0x7F30}
    assert page[0x7F10] == ("STS.128 [R0+0x2000], R48", {"barrier": 1.0, "long_sb": 6.0})
    assert page[0x7F30][1] == {}  # no samples: nothing recorded, "-" read as none
    ops = stalls.by_opcode(page)
    assert [o["opcode"] for o in ops] == ["STS", "LDG"]  # an instruction never sampled adds no opcode
    assert ops[0]["pct"] == pytest.approx(80.0)  # 8 of the 10 samples, the predicated store included
    assert ops[0]["reasons_pct"] == pytest.approx({"long_sb": 70.0, "barrier": 10.0})


def test_missing_or_foreign_page_reads_as_empty(tmp_path):
    assert stalls.source_page(tmp_path / "absent.csv") == {}
    (tmp_path / "error.csv").write_text("==ERROR== the report has no source page\n")
    assert stalls.source_page(tmp_path / "error.csv") == {}
    assert stalls.by_opcode({}) == []


def test_opcode_drops_predicate_and_modifiers():
    assert stalls.opcode("@!P1 STS.128 [R0], R4") == "STS"
    assert stalls.opcode("      LDL.LU R245, [R1+0x70]") == "LDL"
    assert stalls.opcode("") == "?"
