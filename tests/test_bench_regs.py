"""bench/bench_regs.py's SASS loop parser (nvdisasm -c listings), on a hand-written listing: no GPU,
no ptxas needed."""
from test_pipeline_bench import load_bench

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_3:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   MUFU.EX2 R5, R5 ;
        /*0040*/              @!P0 MUFU.EX2 R6, R6 ;
        /*0050*/                   SHFL.BFLY PT, R7, R5, 0x1, 0x1f ;
.L_x_4:
        /*0060*/                   FADD R8, R7, R5 ;
        /*0070*/               @P1 BRA `(.L_x_4) ;
        /*0080*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0090*/               @P0 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
.L_x_5:
        /*00b0*/                   BRA `(.L_x_5);
"""


def test_sass_loops_finds_nested_loops_largest_first():
    loops = load_bench("bench_regs").sass_loops(LISTING)
    assert [(lp["start"], lp["end"], lp["instructions"]) for lp in loops] == [(0x20, 0x90, 8), (0x60, 0x70, 2)]
    # predicated instructions count under their opcode, modifiers dropped; the exit's self-branch is no loop
    assert loops[0]["ops"] == {"MUFU": 2, "BRA": 2, "HGMMA": 1, "SHFL": 1, "FADD": 1, "ISETP": 1}
    assert list(loops[0]["ops"])[0] == "MUFU" and loops[1]["ops"] == {"FADD": 1, "BRA": 1}


def test_sass_loops_of_a_straight_listing_is_empty():
    assert load_bench("bench_regs").sass_loops("        /*0000*/                   EXIT ;\n") == []
