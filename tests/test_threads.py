"""Compiled functions and modules called from several threads at once (an inference server's
workers, a data-parallel loop of threads): each call gets eager's values. A first call of a
signature compiles once while the other threads wait for it (tracing swaps process-wide state and the
module's parameters), and one C program runs one call at a time (its value slots are its own): a
second thread waits, the GIL released, for the first to finish."""
import threading

import pytest
import torch
import torch.nn as nn

import aotfuse
from helpers import assert_close

THREADS = 6


class Mlp(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.up = nn.Linear(64, width)
        self.norm = nn.LayerNorm(width)
        self.down = nn.Linear(width, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x)))).softmax(-1)


def _in_threads(work, n: int = THREADS) -> list:
    """work(i) on n threads started together; their results by i, or the first exception raised."""
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _assert_gradients_per_thread(model: nn.Module, compiled, xs: list, steps: int) -> None:
    """Every thread takes `steps` gradients of compiled(xs[i])'s squared sum by torch.autograd.grad,
    all at once; each equals eager's for its own batch."""
    params = list(model.parameters())
    refs = [torch.autograd.grad(model(x).square().sum(), params) for x in xs]

    def work(i):
        return [torch.autograd.grad(compiled(xs[i]).square().sum(), params) for _ in range(steps)]

    for i, runs in enumerate(_in_threads(work)):
        for k, grads in enumerate(runs):
            for (name, _), g, r in zip(model.named_parameters(), grads, refs[i]):
                assert_close(g, r, f"thread {i}, step {k}: gradient of {name}")


def test_threads_first_calls_compile_a_signature_once_and_get_eagers_values():
    torch.manual_seed(0)
    model = Mlp()
    compiled = aotfuse.memory_efficient_fusion(model)
    xs = [torch.randn(32, 64) for _ in range(THREADS)]
    with torch.no_grad():
        refs = [model(x) for x in xs]

    def work(i):
        with torch.no_grad():
            return [compiled(xs[i]) for _ in range(5)]

    for i, outs in enumerate(_in_threads(work)):
        for k, out in enumerate(outs):
            assert_close(out, refs[i], f"thread {i}, call {k}")
    assert compiled._aotfuse_compiled.compile_count == 1


def test_threads_training_at_once_get_each_their_own_gradients():
    """Gradients by torch.autograd.grad on each thread's own batch, while one thread compiles a new
    batch size (its trace swaps fake parameters into the shared module meanwhile)."""
    torch.manual_seed(1)
    model = Mlp()
    compiled = aotfuse.memory_efficient_fusion(model)
    compiled(torch.randn(32, 64)).square().sum().backward()  # the batch of 32 compiled
    xs = [torch.randn(32 if i else 24, 64) for i in range(THREADS)]  # thread 0: a new signature
    _assert_gradients_per_thread(model, compiled, xs, steps=4)


def test_one_program_called_from_threads_at_once_runs_one_call_at_a_time():
    """A warm program called from every thread (its kernels run without the GIL): before the
    program's lock a second caller failed with 'program is already running'."""
    torch.manual_seed(2)

    def f(x, y):
        return ((x * y).sin() + x.exp() * 0.5).tanh() * y

    compiled = aotfuse.aot_function(f)
    xs = [(torch.randn(512, 1024), torch.randn(512, 1024)) for _ in range(THREADS)]
    compiled(*xs[0])  # compiled (inference signature: no input requires grad)

    def work(i):
        return [compiled(*xs[i]) for _ in range(10)]

    for i, outs in enumerate(_in_threads(work)):
        ref = f(*xs[i])
        for k, out in enumerate(outs):
            assert_close(out, ref, f"thread {i}, call {k}")


@pytest.mark.parametrize("fallback", ["eager", "dynamo"])
def test_threads_under_a_fallback_agree_with_eager(fallback):
    """A function that cannot be captured whole (a data-dependent branch), first called from every
    thread at once: one warning's worth of fallback set up once, every thread gets eager's values."""
    torch.manual_seed(3)

    def f(x):
        return x.sin() if x.sum() > 0 else x.cos() * 2

    compiled = aotfuse.aot_function(f, fallback=fallback)
    # (requiring grad: of an input without, decisions.py answers the branch)
    xs = [(torch.randn(64) + (1 if i % 2 else -1) * 20).requires_grad_() for i in range(THREADS)]
    with pytest.warns(UserWarning, match="could not capture"):
        results = _in_threads(lambda i: [compiled(xs[i]) for _ in range(3)])
    for i, outs in enumerate(results):
        for out in outs:
            assert_close(out, f(xs[i]), f"thread {i}")


def test_threads_through_torch_compile_with_aotfuses_backend():
    """torch.compile(backend="aotfuse") from every thread at once: Dynamo compiles under its lock,
    aotfuse's lazy backward compile under the same one, the programs one call at a time."""
    torch.manual_seed(4)
    model = Mlp()
    compiled = torch.compile(model, backend="aotfuse")
    _assert_gradients_per_thread(model, compiled, [torch.randn(32, 64) for _ in range(THREADS)], steps=3)


def test_a_trace_on_another_thread_does_not_change_a_warm_signature():
    """While one thread traces, its hook probe (a global forward pre-hook) is registered; another
    thread's call of a compiled signature must still find it. Before, the probe's hook id entered
    the other thread's key, and each such call compiled once more (CI saw 7 compiles for 1)."""
    from aotfuse.compile import _HookProbe

    torch.manual_seed(3)
    model = Mlp()
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(32, 64)
    with torch.no_grad():
        ref = model(x)
        compiled(x)
        assert compiled._aotfuse_compiled.compile_count == 1
        probe = _HookProbe("another thread's trace")
        probe.thread = -1  # as if it were another thread's: it notes nothing on this one
        with probe:
            out = compiled(x)
    assert_close(out, ref, "call under another thread's probe")
    assert compiled._aotfuse_compiled.compile_count == 1
