"""The Gluon forward's exponentials on the FMA units (``_gluon_fwd.EXP2_POLY``).

A thread's probabilities 2**x may be computed partly by a cubic on the FMA units instead of the
exp2 unit. The PTX the kernel compiles (``exp2_mixed_asm``) is run here by a small reference
interpreter of the few instructions it uses, so what is checked is that very text: its constants,
operand order and rounding modes. The kernel is then compiled for sm90 to see that the emulated
exponentials leave the exp2 unit in the key loop.
"""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

from flash_ref import GLUON_FWD_SM90_CHILD, load_flash_attn2, run_compiling_child, sass_loops

fa = load_flash_attn2()


def _gluon_fwd():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    return importlib.import_module(fa.__name__ + "._gluon_fwd")


# --------------------------------------------------------------------------------------------
# a reference interpreter of the asm's PTX (values as float32 bit patterns, one lane a column)
# --------------------------------------------------------------------------------------------

_TINY = np.float32(2.0 ** -126)


def _ftz(v: np.ndarray) -> np.ndarray:
    """Subnormal float32 results flushed to a zero of the same sign (the ``.ftz`` modifier)."""
    return np.where(np.abs(v) < _TINY, np.copysign(np.float32(0), v), v).astype(np.float32)


def _round_down(exact: np.ndarray) -> np.ndarray:
    """float64 values rounded to float32 toward -inf (the ``.rm`` modifier)."""
    near = exact.astype(np.float32)
    return np.where(near.astype(np.float64) > exact, np.nextafter(near, np.float32(-np.inf)), near)


def run_ptx(asm: str, inputs: list) -> list:
    """Run ``asm`` (inline-asm text: ``$0..`` outputs, then inputs) on float32 arrays; returns
    the outputs as float32 arrays. Raises AssertionError on an instruction it does not know.

    FMAs are computed in float64 (the product of two float32 is exact there) and rounded once to
    float32, which can differ from a fused rounding in the last bit only where the sum needs more
    than 53 bits; ex2.approx is modelled as the exactly rounded power.
    """
    n_out = len(inputs)
    regs = {f"${n_out + i}": np.asarray(x, np.float32).view(np.uint32) for i, x in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        if tok.startswith("0f"):
            return np.full(len(inputs[0]), int(tok[2:], 16), np.uint32)
        if re.fullmatch(r"-?\d+", tok):
            return np.full(len(inputs[0]), int(tok) & 0xFFFFFFFF, np.uint32)
        return regs[tok]

    def f32(tok: str) -> np.ndarray:
        return val(tok).view(np.float32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "ex2.approx.ftz.f32":
            out = _ftz(np.exp2(f32(src[0]).astype(np.float64)).astype(np.float32))
        elif op == "max.ftz.f32":
            out = _ftz(np.maximum(f32(src[0]), f32(src[1])))
        elif op == "add.rm.ftz.f32":
            out = _ftz(_round_down(f32(src[0]).astype(np.float64) + f32(src[1]).astype(np.float64)))
        elif op == "sub.ftz.f32":
            out = _ftz((f32(src[0]).astype(np.float64) - f32(src[1]).astype(np.float64)).astype(np.float32))
        elif op == "fma.rn.ftz.f32":
            a, b, c = (f32(t).astype(np.float64) for t in src)
            out = _ftz((a * b + c).astype(np.float32))
        elif op == "mad.lo.u32":
            a, b, c = (val(t).astype(np.uint64) for t in src)
            out = ((a * b + c) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
        else:
            raise AssertionError(f"unknown instruction {op!r}")
        regs[dst] = out.view(np.uint32)
    return [regs[f"${i}"].view(np.float32) for i in range(n_out)]


def _emulated(gf, x: np.ndarray) -> np.ndarray:
    """2**x by the cubic: the asm with every value emulated, run on x."""
    return run_ptx(gf.exp2_mixed_asm(1, pack=1), [x])[0]


# --------------------------------------------------------------------------------------------


def test_the_shipped_kernel_keeps_every_exponential_on_the_exp2_unit():
    # not measured on the GPU yet: no head dim takes the cubic, and a share of 0 is plain ex2
    gf = _gluon_fwd()
    assert gf.EXP2_POLY == {}
    assert gf.exp2_mixed_asm(0).count("ex2.approx.ftz.f32") == 8


@pytest.mark.parametrize("poly", [0, 1, 2, 3, 4, 8])
def test_the_asm_emulates_poly_of_every_eight_and_sends_the_rest_to_the_exp2_unit(poly):
    gf = _gluon_fwd()
    asm = gf.exp2_mixed_asm(poly)
    assert asm.count("ex2.approx.ftz.f32") == 8 - poly
    assert asm.count("add.rm.ftz.f32") == poly
    # every output written once, from its own input
    for i in range(8):
        assert len(re.findall(rf"(?:^|\s)\${i},", asm)) == 1, i
        assert f"${8 + i}" in asm


@pytest.mark.parametrize("poly", [-1, 9])
def test_a_share_outside_the_pack_is_refused(poly):
    with pytest.raises(ValueError, match="poly"):
        _gluon_fwd().exp2_mixed_asm(poly)


def test_the_cubic_is_within_its_bound_of_the_true_power_over_the_softmax_range():
    gf = _gluon_fwd()
    # every float32 step of x near 0, and a dense sweep down to where results stop being normal
    x = np.concatenate([np.linspace(-126.0, 8.0, 400_001, dtype=np.float32),
                        -np.arange(0, 4096, dtype=np.float32) * np.float32(2.0 ** -12)])
    got = _emulated(gf, x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1.0)
    # the Remez fit's bound in exact arithmetic is 8.56e-5, float32 rounding adds a few ulps; the
    # bf16 rounding of P the matmul reads is up to 2**-9 = 2e-3, so the cubic adds ~4 % to it
    assert rel.max() < 8.8e-5, (rel.max(), x[rel.argmax()])
    # the interpreter ran the cubic, not the exp2 unit's model (exactly rounded: ~6e-8)
    assert rel.max() > 5e-5


def test_integer_powers_are_exact_and_the_result_never_decreases():
    gf = _gluon_fwd()
    k = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(_emulated(gf, k), np.exp2(k))
    x = np.sort(np.random.default_rng(0).uniform(-126, 8, 200_000).astype(np.float32))
    assert np.all(np.diff(_emulated(gf, x)) >= 0)


def test_masked_and_vanishing_scores_give_zero_or_less_than_the_smallest_normal():
    gf = _gluon_fwd()
    x = np.array([-np.inf, -1e30, -300.0, -127.0, -126.75, -126.5, -126.01], np.float32)
    got = _emulated(gf, x)
    assert got[0] == 0.0 and got[1] == 0.0 and got[2] == 0.0 and got[3] == 0.0  # clamped to -127: +0
    assert np.all(got >= 0.0) and np.all(got < 2.0 ** -126)  # what the exp2 unit flushes to zero


def test_mixed_packs_put_the_cubic_and_the_exp2_unit_side_by_side():
    gf = _gluon_fwd()
    rng = np.random.default_rng(1)
    ins = [rng.uniform(-40, 0, 1000).astype(np.float32) for _ in range(8)]
    ins[5][:3] = -np.inf
    outs = run_ptx(gf.exp2_mixed_asm(2), ins)
    exact = [np.exp2(i.astype(np.float64)) for i in ins]
    for i in range(8):
        live = exact[i] > 0
        assert np.abs(outs[i][live] / exact[i][live] - 1).max() < 8.8e-5, i
    assert np.all(outs[5][:3] == 0.0)
    # positions 3 and 7 are the emulated ones: they differ from the exactly rounded power
    differs = [not np.array_equal(outs[i], exact[i].astype(np.float32)) for i in range(8)]
    assert differs == [False, False, False, True, False, False, False, True]


def test_a_softmax_row_with_a_quarter_emulated_matches_the_exact_one():
    # what the kernel computes from these values: P = 2**(s - max), its row sum, O = P V / sum
    gf = _gluon_fwd()
    rng = np.random.default_rng(2)
    s = rng.normal(0, 3, (64, 128)).astype(np.float32)
    x = (s - s.max(axis=1, keepdims=True)).astype(np.float32)
    v = rng.normal(0, 1, (128, 64))
    flat = x.reshape(-1, 8)
    p = np.stack(run_ptx(gf.exp2_mixed_asm(2), [flat[:, i] for i in range(8)]), 1).reshape(x.shape)
    p_exact = np.exp2(x.astype(np.float64))
    o = (p.astype(np.float64) @ v) / p.sum(axis=1, keepdims=True)
    o_exact = (p_exact @ v) / p_exact.sum(axis=1, keepdims=True)
    assert np.abs(o - o_exact).max() < 1e-4 * np.abs(o_exact).max()


def _key_loops(sass: str) -> list:
    """The SASS loops that issue wgmma and exponentials: per loop, the counts of MUFU.EX2, of
    FADD rounding down (FADD.FTZ.RM) and of instructions."""
    return [(sum("MUFU.EX2" in t for t in body), sum("FADD.FTZ.RM" in t for t in body), len(body))
            for body in sass_loops(sass)
            if any("HGMMA" in t for t in body) and any("MUFU.EX2" in t for t in body)]


def test_two_of_every_eight_exponentials_leave_the_exp2_unit_in_the_key_loop(tmp_path):
    # head_dim 64, 128 keys a block: a thread computes 64 probabilities a step and two rescale
    # factors; with EXP2_POLY 2 the exp2 unit keeps 48 + 2 of them and 16 go to the FMA units
    _gluon_fwd()
    args = (64, 0, 0, 2, "shipped", "shipped", "shipped", "sass", "shipped", "2")
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    loops = _key_loops(done.stdout)
    # the innermost key loops (one step a trip): the unmasked and masked steps of the consumers
    steps = [(mufu, rm) for mufu, rm, n in loops if mufu <= 66]
    assert len(steps) >= 2, loops
    assert all(mufu == 48 + 2 and rm == 16 for mufu, rm in steps), steps
