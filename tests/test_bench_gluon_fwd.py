"""bench/gluon_fwd.py's ``gluon_nobar`` variant: which warpgroup barriers its PTX edit removes;
and its ``--kernels`` selection, which refuses a name it does not know.

The fragments are the Gluon forward's own sm90 PTX (Triton 3.6), cut down: a barrier before a
ring wait and one before a one-thread slot release go; the epilogue's barriers (before the copy
engine's store, and the one after its read that precedes a later arrive) stay."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import gluon_fwd  # noqa: E402

WAIT = """\tbfe.u32 \t%r2111, %r2216, 2, 1;
\t.loc\t1 305 39                        // _gluon_fwd.py:305:39 @[ _gluon_fwd.py:380:37 ]
\tbar.sync \t0, 128;
\t// begin inline asm
\t
{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r2110], %r2111;
\t@!complete bra.uni waitLoop;
}

\t// end inline asm
"""
RELEASE = """\tadd.s32 \t%r2210, %r2233, 164176;
$L__tmp29:
\t.loc\t1 268 24                        // _gluon_fwd.py:268:24 @[ _gluon_fwd.py:322:38 @[ _gluon_fwd.py:380:37 ] ]
\tbar.sync \t0, 128;
\t// begin inline asm
\t@%p124 mbarrier.arrive.shared::cta.b64 _, [%r2210];
\t// end inline asm
"""
EPILOGUE = """\t.loc\t1 423 48                        // _gluon_fwd.py:423:48
\tbar.sync \t0, 128;
\telect.sync \t%r3120|%p232, -1;
\tand.pred \t%p226, %p227, %p232;
\tcp.async.bulk.wait_group.read \t0;
\t.loc\t1 425 12                        // _gluon_fwd.py:425:12
\tbar.sync \t0, 128;
\t.loc\t1 426 38                        // _gluon_fwd.py:426:38
\tshl.b32 \t%r3121, %r147, 3;
\t// begin inline asm
\t@%p124 mbarrier.arrive.shared::cta.b64 _, [%r3090];
\t// end inline asm
"""


def test_the_barriers_before_ring_waits_and_slot_releases_go():
    out = gluon_fwd._strip_ring_barriers(WAIT + RELEASE)
    assert "bar.sync" not in out
    # nothing else is touched
    assert out.splitlines() == [line for line in (WAIT + RELEASE).splitlines() if "bar.sync" not in line]


def test_the_epilogue_barriers_stay():
    assert gluon_fwd._strip_ring_barriers(EPILOGUE) == EPILOGUE
    assert gluon_fwd._strip_ring_barriers(EPILOGUE + WAIT).count("bar.sync") == 2



def test_kernels_are_kept_by_name_and_an_unknown_name_is_refused(monkeypatch):
    import pytest

    monkeypatch.setattr(gluon_fwd, "KERNELS", {d: dict(kernels) for d, kernels in gluon_fwd.KERNELS.items()})
    with pytest.raises(ValueError, match="gluon_poly9.*known: .*gluon_poly1"):
        gluon_fwd.keep_kernels(["gluon", "gluon_poly9"], (64, 128))
    # a name some selected head dim has is fine; each head dim keeps what it has of the list
    gluon_fwd.keep_kernels(["gluon", "gluon_n64s8", "gluon_ds"], (64, 128))
    assert set(gluon_fwd.KERNELS[64]) == {"gluon", "gluon_n64s8", "gluon_ds"}
    assert set(gluon_fwd.KERNELS[128]) == {"gluon", "gluon_ds"}


def test_the_gpu_scripts_variant_runs_name_kernels_the_benchmark_has():
    # a misspelt name would cost a GPU run: every --kernels list in gpu_kernel.sh is checked against
    # KERNELS at the head dims the same command gives
    import re

    script = (Path(__file__).resolve().parent.parent / "bench" / "gpu_kernel.sh").read_text().replace("\\\n", " ")
    runs = re.findall(r"gluon_fwd\.py --kernels (\S+)\s+--head-dims (\S+)", script)
    assert len(runs) >= 2
    for names, head_dims in runs:
        for d in map(int, head_dims.split(",")):
            assert set(names.split(",")) <= set(gluon_fwd.KERNELS[d]), (d, names)
