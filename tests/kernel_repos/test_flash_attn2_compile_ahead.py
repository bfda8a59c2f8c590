"""Compiling ahead: the backward kernels a training forward sets compiling on the compile threads
must be exactly the ones its backward launches (else the first backward still compiles), and
the pool compiles only what is missing.

No GPU here: launches are recorded (launch_record.py) and compared through Triton's own
specialiser, which decides what a compiled kernel may be reused for.
"""

from __future__ import annotations

import importlib
import itertools
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flash_ref import load_flash_attn2, run_compiling_child
from launch_record import recording, triton_specialisation

fa = load_flash_attn2()
autograd = importlib.import_module(fa.__name__ + "._autograd")
fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
bwd = importlib.import_module(fa.__name__ + "._triton_bwd")
launch = importlib.import_module(fa.__name__ + "._launch")


def _cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def _case(name):
    """(q, k, v, keyword arguments of the forward) for a named case; bf16 CPU tensors (only
    their layout matters: nothing runs)."""
    bf = dict(dtype=torch.bfloat16)
    if name == "dense-causal-d128":
        q, k, v = (torch.empty(2, 256, 4, 128, **bf) for _ in range(3))
        return q, k, v, dict(causal=True)
    if name == "gqa-window-softcap-d64":
        return (torch.empty(1, 200, 8, 64, **bf), torch.empty(1, 333, 2, 64, **bf), torch.empty(1, 333, 2, 64, **bf),
                dict(window_size=(32, 7), softcap=30.0))
    if name == "varlen-kvpacked-d80-everything":
        lq, lk = [512, 404, 437, 333], [256, 157, 205, 140]
        k, v = torch.empty(sum(lk), 2, 6, 80, **bf).unbind(1)
        return (torch.empty(sum(lq), 6, 80, **bf), k, v,
                dict(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=512, max_seqlen_k=256, causal=True,
                     softcap=50.0, dropout_p=0.17, alibi_slopes=torch.rand(4, 6)))
    if name == "qkvpacked-d59-strided":
        # views whose k and v start 354 bytes in (not 16-byte aligned) and q with a head_dim stride
        _, k, v = torch.empty(2, 97, 3, 3, 59, **bf).unbind(2)
        return torch.empty(2, 97, 3, 118, **bf)[..., ::2], k, v, dict(causal=True)
    raise KeyError(name)


CASES = ["dense-causal-d128", "gqa-window-softcap-d64", "varlen-kvpacked-d80-everything", "qkvpacked-d59-strided"]


def _opts(q, kw):
    """The option dict the autograd function carries (as ``_autograd.attention`` builds it)."""
    return dict(max_seqlen_q=kw.get("max_seqlen_q"), max_seqlen_k=kw.get("max_seqlen_k"),
                softmax_scale=q.shape[-1] ** -0.5, causal=kw.get("causal", False),
                window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                dropout_p=kw.get("dropout_p", 0.0), seed=11)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["sm90", "sm80"])
def test_the_backward_compiled_ahead_is_the_backward_launched(name, capability, monkeypatch):
    q, k, v, kw = _case(name)
    opts = _opts(q, kw)
    tensors = dict(alibi_slopes=kw.get("alibi_slopes"), cu_seqlens_q=kw.get("cu_seqlens_q"),
                   cu_seqlens_k=kw.get("cu_seqlens_k"))
    monkeypatch.setattr(autograd, "_BACKWARD_AHEAD", set())
    with recording(fa, monkeypatch, capability) as ahead:
        autograd._backward_ahead(q, k, v, tensors["alibi_slopes"], tensors["cu_seqlens_q"], tensors["cu_seqlens_k"],
                                 None, opts)
    with recording(fa, monkeypatch, capability) as real:
        qc, kc, vc = (t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, v))
        out, lse = fwd.attention_forward(qc, kc, vc, **tensors, **opts)
        real.clear()
        bwd.attention_backward(torch.empty_like(out), qc, kc, vc, out, lse, **tensors, **opts)
    real = [r for r in real if r.grid is not None]  # the backward's own compile request, then its launches
    # the dQ kernel runs unless dQ is reduced inside dK/dV (sm90, head dims the table lists)
    block_d = fwd.next_pow2_dim(q.shape[-1])
    keys = kw["max_seqlen_k"] if "max_seqlen_k" in kw else k.shape[1]
    fused = bwd.dq_mode(capability, block_d, bwd._configs.pick("bwd", capability, block_d)[0][4], False,
                        kw.get("causal", False), keys)
    assert [r.name for r in ahead] == [r.name for r in real] == \
        ["_delta_kernel", "_bwd_dkdv_kernel"] + (["_dq_cast_kernel"] if fused else ["_bwd_dq_kernel"])
    for a, r in zip(ahead, real):
        assert triton_specialisation(a) == triton_specialisation(r), r.name
        # stronger than the specialisation: the same integers, and tensors of one layout
        assert [_layout(x) for x in a.args] == [_layout(x) for x in r.args], r.name


def _layout(x):
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.stride(), x.data_ptr() % 16 == 0)
    if type(x).__name__ == "TensorDescriptor":
        return (_layout(x.base), tuple(x.shape), tuple(x.strides), tuple(x.block_shape))
    return x


def test_each_feature_class_is_compiled_ahead_once(monkeypatch):
    q, k, v, kw = _case("dense-causal-d128")
    monkeypatch.setattr(autograd, "_BACKWARD_AHEAD", set())
    with recording(fa, monkeypatch) as ahead:
        autograd._backward_ahead(q, k, v, None, None, None, None, _opts(q, kw))
        autograd._backward_ahead(q, k, v, None, None, None, None, _opts(q, kw))
        assert len(ahead) == 3
        autograd._backward_ahead(q, k, v, None, None, None, None, _opts(q, dict(kw, causal=False)))
    assert len(ahead) == 6


class _Compiled:
    def __init__(self):
        self.loaded_on = None

    def _init_handles(self):
        self.loaded_on = threading.current_thread().name


class _FakeJit:
    """Plays a Triton kernel for the pool: warmup compiles (records the thread), [grid] launches."""

    arg_names = ["X", "n", "BLOCK"]
    constexprs = [2]

    def __init__(self):
        self.warmups = []
        self.compiled = _Compiled()

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((threading.current_thread().name, args[1], kwargs["BLOCK"]))
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


@pytest.fixture
def fake_driver(monkeypatch):
    driver_module = sys.modules["triton.runtime.driver"]
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1)
    monkeypatch.setattr(driver_module, "driver", SimpleNamespace(active=active))


def test_the_pool_compiles_what_is_missing_on_its_threads(fake_driver, monkeypatch):
    jit = _FakeJit()
    launcher = launch.Launcher(jit)
    x = torch.zeros(8)
    futures = launch.compile_all([(launcher, (x, 32), (16,), 4, 2), (launcher, (x, 33), (64,), 4, 2)])
    launch.wait(futures)
    assert len(futures) == 2
    assert sorted(w[1:] for w in jit.warmups) == [(32, 16), (33, 64)]
    assert all(w[0].startswith("flash_attn2-compile") for w in jit.warmups)
    assert jit.compiled.loaded_on.startswith("flash_attn2-compile")  # the module loads there too
    # compiled ahead: asking again compiles nothing; 48 is in 32's class, 1 is not
    assert launch.compile_all([(launcher, (x, 48), (16,), 4, 2), (launcher, (x, 33), (64,), 4, 2)]) == []
    launch.wait(launch.compile_all([(launcher, (x, 1), (16,), 4, 2)]))
    assert len(jit.warmups) == 3
    monkeypatch.setattr(launch, "COMPILE_THREADS", 0)
    assert launch.compile_all([(launcher, (x, 2), (16,), 4, 2)]) == []


def test_a_compile_error_surfaces_where_the_launch_waits():
    class Broken(_FakeJit):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("out of shared memory")

    futures = launch.compile_all([(launch.Launcher(Broken()), (torch.zeros(4), 16), (16,), 4, 2)])
    with pytest.raises(RuntimeError, match="out of shared memory"):
        launch.wait(futures)


def test_the_compiler_hash_is_computed_once_on_the_calling_thread_before_the_pool_starts(fake_driver, monkeypatch):
    # Triton caches that hash without a lock: compile threads started together would each read
    # libtriton again, contending with the forward's compile on the calling thread
    import triton.runtime.cache as cache

    calls = []
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(threading.current_thread().name) or "key")
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)

    class Records(_FakeJit):
        def warmup(self, *args, grid, **kwargs):
            calls.append("compile")
            return super().warmup(*args, grid=grid, **kwargs)

    launcher = launch.Launcher(Records())
    x = torch.zeros(8)
    launch.wait(launch.compile_all([(launcher, (x, 32), (16,), 4, 2), (launcher, (x, 33), (64,), 4, 2)]))
    launch.wait(launch.compile_all([(launcher, (x, 1), (16,), 4, 2)]))
    assert calls[0] == threading.current_thread().name and calls[1:] == ["compile"] * 3


def test_a_hash_started_in_the_background_is_waited_for_instead_of_computed_again(fake_driver, monkeypatch):
    # the package starts it when imported with a CUDA build of torch, so that the first call,
    # cold or from a prepared cache, does not read libtriton itself
    import triton.runtime.cache as cache

    release = threading.Event()
    calls = []

    def slow_key():
        calls.append(threading.current_thread().name)
        release.wait(5)
        return "key"

    monkeypatch.setattr(cache, "triton_key", slow_key)
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)
    monkeypatch.setattr(launch, "_HASHING", None)
    monkeypatch.setattr(launch, "_HELPER", None)
    launch.hash_compiler_in_background()
    hashing = launch._HASHING
    assert hashing is not None and hashing.daemon
    launch.hash_compiler_in_background()  # once per process
    assert launch._HASHING is hashing

    waited = threading.Thread(target=launch._hash_compiler_once)
    waited.start()
    waited.join(0.2)
    assert waited.is_alive()  # the first compile waits for the hash...
    release.set()
    waited.join(5)
    assert not waited.is_alive() and not hashing.is_alive()
    assert calls == ["flash_attn2-compiler-hash"]  # ...and does not compute it again
    launch._hash_compiler_once()
    assert calls == ["flash_attn2-compiler-hash"]


def test_no_background_hash_with_the_compile_threads_off(monkeypatch):
    monkeypatch.setattr(launch, "COMPILE_THREADS", 0)
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)
    monkeypatch.setattr(launch, "_HASHING", None)
    monkeypatch.setattr(launch, "_HELPER", None)
    launch.hash_compiler_in_background()
    assert launch._HASHING is None


def test_a_failing_background_hash_leaves_the_compile_to_raise(fake_driver, monkeypatch):
    import triton.runtime.cache as cache

    def broken():
        raise OSError("libtriton unreadable")

    monkeypatch.setattr(cache, "triton_key", broken)
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)
    monkeypatch.setattr(launch, "_HASHING", None)
    monkeypatch.setattr(launch, "_HELPER", None)
    launch.hash_compiler_in_background()
    launch._HASHING.join(5)
    launch._hash_compiler_once()  # returns: Triton's compile calls triton_key itself and raises there
    assert launch._COMPILER_HASHED


def test_tritons_cuda_helper_is_built_beside_the_hash_and_cuda_is_left_alone(monkeypatch):
    # Triton builds its CUDA helper module (C, with gcc) when its driver is first created, at the
    # first launch; a second background thread builds it while the first one hashes, without
    # creating the driver: that would ask torch whether CUDA is available, initialising CUDA at
    # import, and a process the job forks later could not use CUDA any more
    import triton.backends.nvidia.driver as nvidia_driver
    import triton.runtime.cache as cache

    events = []
    hashing, building = threading.Event(), threading.Event()
    release_hash, release_helper = threading.Event(), threading.Event()

    def slow_key():
        events.append(("hash", threading.current_thread().name))
        hashing.set()
        release_hash.wait(5)

    class Helper:
        def __init__(self):
            events.append(("helper", threading.current_thread().name))
            building.set()
            release_helper.wait(5)

    monkeypatch.setattr(cache, "triton_key", slow_key)
    monkeypatch.setattr(nvidia_driver, "CudaUtils", Helper)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: events.append(("cuda", None)) or False)
    monkeypatch.setattr(torch.cuda, "init", lambda: events.append(("cuda", None)))
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)
    monkeypatch.setattr(launch, "_HASHING", None)
    monkeypatch.setattr(launch, "_HELPER", None)
    launch.hash_compiler_in_background()
    # both are under way at once: the helper does not wait for the hash
    assert hashing.wait(5) and building.wait(5)
    waited = threading.Thread(target=launch._hash_compiler_once)
    waited.start()
    release_hash.set()
    waited.join(0.2)
    assert waited.is_alive()  # the first compile waits for the helper module too...
    release_helper.set()
    waited.join(5)
    assert not waited.is_alive()
    # ...each built once on its own thread, and CUDA never asked about
    assert sorted(events) == [("hash", "flash_attn2-compiler-hash"), ("helper", "flash_attn2-cuda-helper")]


def test_a_failing_helper_build_is_left_to_the_first_launch(monkeypatch):
    import triton.backends.nvidia.driver as nvidia_driver
    import triton.runtime.cache as cache

    class NoCompiler:
        def __init__(self):
            raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(cache, "triton_key", lambda: "key")
    monkeypatch.setattr(nvidia_driver, "CudaUtils", NoCompiler)
    monkeypatch.setattr(launch, "_COMPILER_HASHED", False)
    monkeypatch.setattr(launch, "_HASHING", None)
    monkeypatch.setattr(launch, "_HELPER", None)
    launch.hash_compiler_in_background()
    launch._hash_compiler_once()  # returns: Triton's driver builds it at the first launch and raises there
    assert launch._COMPILER_HASHED and not launch._HASHING.is_alive()


_HELPER_CHILD = """
import os
import torch
import triton.runtime.build as build
import triton.backends.nvidia.driver as nvidia_driver
import _fa2_sm90._launch as launch
launch._HASHING, launch._COMPILER_HASHED, launch.COMPILE_THREADS = None, False, 2
launch.hash_compiler_in_background()
launch._hash_compiler_once()
built = sorted(os.listdir(os.environ["TRITON_CACHE_DIR"]))


def no_compiler(*args, **kwargs):
    raise RuntimeError("the C compiler ran again")


build._build = no_compiler
nvidia_driver.CudaUtils()  # what Triton's driver does at the first launch: found in the cache
print(len(built), torch.cuda.is_initialized())
"""


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="Triton builds its CUDA helper with the host's C compiler, and there is none")
def test_the_helper_module_built_in_the_background_is_what_tritons_driver_finds_at_the_first_launch(
        tmp_path, monkeypatch):
    # a real build, as on a GPU node with an empty cache: Triton's own C source compiled by gcc
    # against a stand-in libcuda (every cu* function it names, returning an error; nothing calls
    # them), then Triton's own constructor loads it without compiling
    import triton.backends.nvidia.driver as nvidia_driver

    source = (Path(nvidia_driver.__file__).parent / "driver.c").read_text()
    names = sorted(set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", source)))
    stub = tmp_path / "libcuda"
    stub.mkdir()
    (stub / "stub.c").write_text("".join(f"int {name}(void) {{ return 999; }}\n" for name in names))
    subprocess.run([shutil.which("gcc") or shutil.which("cc"), "-shared", "-fPIC", str(stub / "stub.c"), "-o",
                    str(stub / "libcuda.so.1")], check=True)
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(stub))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stub))
    cache_dir = tmp_path / "cache"
    done = run_compiling_child(_HELPER_CHILD, (), cache_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "False"]  # one module built, CUDA not initialised


_HASH_THREAD_CHILD = """
import threading
import _fa2_sm90._launch as launch
assert "triton" not in sys.modules, "importing the package imported Triton"
gate = threading.Event()
real_key = launch._triton_key
launch._triton_key = lambda: (gate.wait(10), real_key())
launch._HASHING, launch._COMPILER_HASHED, launch.COMPILE_THREADS = None, False, 2
launch.hash_compiler_in_background()
started = launch._HASHING is not None
imported = "triton.runtime.cache" in sys.modules and hasattr(sys.modules["triton"], "backends")
before = set(sys.modules)
gate.set()
launch._HASHING.join(60)
print(started, imported, not launch._HASHING.is_alive(), sorted(set(sys.modules) - before) == [])
"""


def test_triton_is_imported_on_the_calling_thread_before_the_hash_thread_starts(tmp_path):
    # imported for the first time on the hashing thread, Triton raced with the caller's own
    # imports of it (torch.compile right after the package's import found Triton half imported);
    # the hash itself imports nothing once Triton is (a fresh process: the test suite's own
    # Triton is imported long ago)
    done = run_compiling_child(_HASH_THREAD_CHILD, (), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # started, Triton imported before it, the hash done, and no module imported by the hash
    assert done.stdout.split() == ["True", "True", "True", "True"]


_POOL_CHILD = """
import threading
import _fa2_sm90._launch as launch
gate = threading.Event()
seen = []


class Job:  # a launcher whose compile only waits: any import meanwhile is the caller's
    def ready(self, *args):
        return False

    def warmup(self, *args):
        gate.wait(10)


launch.COMPILE_THREADS, launch._COMPILER_HASHED = 2, True
assert "triton.compiler.code_generator" not in sys.modules
futures = launch.compile_all([(Job(), (), (), 4, 2)])
seen.append("triton.compiler.code_generator" in sys.modules)
gate.set()
launch.wait(futures)
print(len(futures), seen[0])
"""


def test_the_compiler_is_imported_on_the_calling_thread_before_the_pool_compiles(tmp_path):
    # a first compile imports Triton's code generator and Gluon's language modules; imported
    # by the pool's threads and the caller at once, one of them could fail (see the test above)
    done = run_compiling_child(_POOL_CHILD, (), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "True"]
