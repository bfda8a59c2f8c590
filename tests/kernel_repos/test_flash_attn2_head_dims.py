"""Every head dim flash-attention accepts (1..256) has a launch config on every path and GPU family,
and the narrow ones (16 and below, odd ones) compute the reference under the interpreter."""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import load_flash_attn2, reference, rel_err

fa = load_flash_attn2()
configs = importlib.import_module(fa.__name__ + "._configs")
fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
decode = importlib.import_module(fa.__name__ + "._triton_decode")

HEAD_DIMS = range(1, 257)
# None = the interpreter; then A100, A10/L4-class, L40/4090-class, H100/H200, a newer major.
CAPABILITIES = [None, (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]


def _is_fwd_config(cfg) -> bool:
    return len(cfg) == 4 and all(isinstance(x, int) and x > 0 for x in cfg)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=str)
def test_every_head_dim_has_a_config_on_every_path(cap):
    for d in HEAD_DIMS:
        block_d = fwd.next_pow2_dim(d)
        assert block_d in configs.PADDED_HEAD_DIMS and block_d >= d
        assert _is_fwd_config(configs.pick("fwd", cap, block_d)), (cap, d)
        for masked_right in (False, True):
            for group, keys in ((1, 1024), (1, 16384), (4, 4096)):
                cfg = configs.pick_fwd(cap, block_d, masked_right, group, keys)
                assert _is_fwd_config(cfg), (cap, d, masked_right, group, keys)
        dkdv, dq = configs.pick("bwd", cap, block_d)
        assert _is_fwd_config(dkdv[:4]) and dkdv[4] in ("keys", "queries", "keys-2pass"), (cap, d)
        assert _is_fwd_config(dq), (cap, d)
        for big_smem in (False, True):
            block_n, warps, stages = decode._config_for(d, big_smem)
            assert block_n >= 16 and warps > 0 and stages > 0


def test_a_16_wide_head_uses_the_tiles_of_32():
    for cap in CAPABILITIES:
        assert configs.pick("fwd", cap, 16) == configs.pick("fwd", cap, 32)
        assert configs.pick("bwd", cap, 16) == configs.pick("bwd", cap, 32)


# (head_dim, options) small enough for the interpreter; 16 and below pad to a 16-wide tile.
NARROW = [(16, {}), (16, dict(causal=True)), (8, dict(window_size=(3, 2))), (5, dict(causal=True, softcap=2.0)),
          (24, dict(causal=True))]


@pytest.mark.parametrize("d, opts", NARROW, ids=[f"d{d}-{'-'.join(o) or 'plain'}" for d, o in NARROW])
def test_narrow_heads_match_the_reference_forward_and_backward(d, opts):
    q = torch.randn(2, 19, 4, d, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 23, 2, d, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 23, 2, d, dtype=torch.float16, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, **opts)
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qr, kr, vr, **opts)
    ref_out.backward(dout.double())
    errors = {name: rel_err(got, want) for name, got, want in
              (("out", out, ref_out), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad))}
    assert all(e < 3e-3 for e in errors.values()), errors


@pytest.mark.parametrize("d", [16, 7])
def test_narrow_heads_through_the_paged_kv_cache(d):
    page, pages = 8, 6
    k_cache = torch.randn(pages, page, 2, d, dtype=torch.float16)
    v_cache = torch.randn(pages, page, 2, d, dtype=torch.float16)
    block_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([13, 21], dtype=torch.int32)
    q = torch.randn(2, 1, 4, d, dtype=torch.float16)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=block_table)
    for b in range(2):
        n = int(lens[b])
        rows = torch.cat([k_cache[p] for p in block_table[b].tolist()])[:n]
        vals = torch.cat([v_cache[p] for p in block_table[b].tolist()])[:n]
        want, _ = reference(q[b:b + 1].double(), rows[None].double(), vals[None].double())
        assert rel_err(out[b:b + 1], want) < 3e-3


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)], ids=str)
def test_every_head_dim_launches_on_every_path_of_every_gpu_family(cap, monkeypatch):
    """The entry points themselves (not only the tables) for head dims 1..256 on each GPU family:
    dense causal and not, GQA, varlen, the backward, decode and the kv cache build their launches
    without a missing config (the launches are recorded, not run: no GPU here)."""
    from launch_record import recording

    autograd = importlib.import_module(fa.__name__ + "._autograd")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with recording(fa, monkeypatch, cap) as rec:
        for d in HEAD_DIMS:
            mk = lambda *s: torch.empty(*s, d, dtype=torch.float16, requires_grad=True)  # noqa: E731
            for causal in (False, True):
                fa.flash_attn_func(mk(1, 20, 4), mk(1, 20, 2), mk(1, 20, 2), causal=causal).sum().backward()
            fa.flash_attn_varlen_func(mk(12, 2), mk(12, 2), mk(12, 2), cu, cu, 7, 7, causal=True).sum().backward()
            with torch.no_grad():
                fa.flash_attn_func(mk(2, 1, 4), mk(2, 30, 2), mk(2, 30, 2))
                fa.flash_attn_with_kvcache(mk(2, 1, 4).detach(), mk(2, 32, 2).detach(), mk(2, 32, 2).detach(),
                                           cache_seqlens=torch.tensor([9, 30], dtype=torch.int32))
            rec_names = {r.name for r in rec}
            assert {"_fwd_kernel", "_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_split_kernel"} <= rec_names, d
            rec.clear()
    assert autograd.backend_for(torch.empty(1)) == "interpreter"
