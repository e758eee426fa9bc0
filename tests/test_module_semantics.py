"""What a user does with a compiled module besides calling it: Python hooks on its submodules
(before and after it compiled), copying and saving it whole, torch.func transforms around it, and
compilers around it (another compiled module holding it, torch.compile of it).

Hooks: a captured graph runs a hook once, while tracing, with traced tensors; one recording
activations or counting calls would record fakes and count traces. So aotfuse traces only hooks known
to act through the forward's values (torch's own, transformers' output recording) and treats any
other like a branch it cannot capture (HooksError: CaptureError, or the fallback). The hooks are part
of each signature: one registered or removed later makes another."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse import CaptureError
from helpers import assert_close, assert_grads_match


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _ran_compiled(compiled) -> bool:
    entry = compiled._aotfuse_compiled.last_entry
    return entry is not None and entry.fallback is None


def test_a_recording_hook_is_refused_by_default_naming_it():
    model = _net()
    model.fc1.register_forward_hook(lambda m, i, o: None)
    compiled = aotfuse.memory_efficient_fusion(model)
    with pytest.raises(CaptureError, match=r"Python hooks.*fc1\.forward_hooks"):
        compiled(torch.randn(2, 8))


@pytest.mark.parametrize("fallback", ["eager", "dynamo"])
def test_a_recording_hook_runs_at_every_call_under_a_fallback(fallback):
    """Before: the hook ran once, while tracing, and recorded FakeTensors; every later call skipped it."""
    model = _net()
    seen = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    compiled = aotfuse.memory_efficient_fusion(model, fallback=fallback)
    xs = [torch.randn(2, 8) for _ in range(3)]
    with pytest.warns(UserWarning, match="could not capture"):
        outs = [compiled(x) for x in xs]
    assert len(seen) == 3 and all(type(a) is torch.Tensor for a in seen)
    for k, x in enumerate(xs):
        assert_close(seen[k], model.fc1(x).detach(), f"recorded activation {k}")
        assert_close(outs[k], model(x), f"output {k}")


def test_backward_hooks_run_at_every_backward_under_the_eager_fallback():
    model = _net()
    grads = []
    model.fc1.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].clone()))
    compiled = aotfuse.memory_efficient_fusion(model, fallback="eager")
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="could not capture"):
        compiled(x).sum().backward()
    compiled(x).sum().backward()
    assert len(grads) == 2 and all(type(g) is torch.Tensor for g in grads)


def test_a_hook_registered_after_compiling_is_not_ignored():
    """Before: the compiled program kept running without it (another answer than eager's)."""
    model = _net()
    compiled = aotfuse.memory_efficient_fusion(model, fallback="eager")
    x = torch.randn(2, 8)
    assert_close(compiled(x), model(x), "before the hook")
    assert _ran_compiled(compiled)
    handle = model.fc2.register_forward_pre_hook(lambda m, args: (args[0] * 3,))
    with pytest.warns(UserWarning, match="could not capture"):
        out = compiled(x)
    assert_close(out, model(x), "with the hook")
    assert not _ran_compiled(compiled)
    handle.remove()
    assert_close(compiled(x), model(x), "after removing it")
    assert _ran_compiled(compiled)  # the first signature's programs again
    assert compiled._aotfuse_compiled.compile_count == 2


def test_a_hook_the_forward_registers_on_a_tensor_is_refused_or_run_eagerly():
    seen = []

    class Tapped(Net):
        def forward(self, x):
            h = self.fc1(x)
            h.register_hook(lambda g: seen.append(g.clone()))
            return self.fc2(torch.tanh(h))

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    with pytest.raises(CaptureError, match="registers hooks"):
        aotfuse.memory_efficient_fusion(Tapped())(x)
    compiled = aotfuse.memory_efficient_fusion(Tapped(), fallback="eager")
    seen.clear()
    with pytest.warns(UserWarning, match="could not capture"):
        compiled(x).sum().backward()
    compiled(x).sum().backward()
    assert len(seen) == 2 and all(type(g) is torch.Tensor for g in seen)


def test_torchs_own_hooks_are_traced_into_the_programs():
    """Quantization's observer hook (torch.ao): fc1's output through a MinMaxObserver, whose running
    min and max are buffers it updates in place; captured whole, the buffers move as eager's."""
    from torch.ao.quantization import MinMaxObserver
    from torch.ao.quantization.quantize import _observer_forward_hook

    model, twin = _net(), _net()
    for m in (model, twin):
        m.fc1.activation_post_process = MinMaxObserver()
        m.fc1.register_forward_hook(_observer_forward_hook)
    compiled = aotfuse.memory_efficient_fusion(twin)
    for k in range(3):
        x = torch.randn(4, 8) * (k + 1)
        out, ref = compiled(x), model(x)
        assert _ran_compiled(compiled)
        assert_close(out, ref, f"output {k}")
        out.square().sum().backward()
        ref.square().sum().backward()
        for name in ("min_val", "max_val"):
            assert_close(getattr(twin.fc1.activation_post_process, name),
                         getattr(model.fc1.activation_post_process, name), f"call {k}: the observer's {name}")
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert_close(p.grad, q.grad, f"gradient of {name}")


def test_hooks_on_the_compiled_module_itself_run_around_its_programs():
    model = _net()
    compiled = aotfuse.memory_efficient_fusion(model)
    seen = []
    compiled.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    x = torch.randn(2, 8)
    for _ in range(2):
        out = compiled(x)
        assert _ran_compiled(compiled)
    assert len(seen) == 2 and all(type(a) is torch.Tensor for a in seen)
    assert_close(seen[-1], out.detach(), "the hook's output")


def test_transformers_output_recording_is_traced_into_the_programs():
    """transformers 5 records output_hidden_states with forward hooks it installs at the first
    call asking for them (inside the traced forward): a pure recording, captured whole."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg)
    compiled = aotfuse.memory_efficient_fusion(model)
    ids = torch.randint(0, 64, (2, 8))
    out = compiled(input_ids=ids, labels=ids, output_hidden_states=True)
    assert _ran_compiled(compiled)
    ref = model(input_ids=ids, labels=ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    for k, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        assert type(a) is torch.Tensor
        assert_close(a, b, f"hidden state {k}")
    assert_close(out.loss, ref.loss, "loss")
    plain = compiled(input_ids=ids, labels=ids)  # hooks installed now, recording nothing
    assert _ran_compiled(compiled) and plain.hidden_states is None


def test_transformers_gradient_checkpointing_hook_is_traced_into_the_programs():
    """gradient_checkpointing_enable() installs a forward hook on the input embeddings (they require
    grad): captured whole, the step's gradients as eager's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.BertForMaskedLM(cfg))
        models[-1].gradient_checkpointing_enable()
        models[-1].train()
    model, twin = models
    assert any(m._forward_hooks for m in twin.modules())  # the hook this test is about
    compiled = aotfuse.memory_efficient_fusion(twin)
    ids = torch.randint(0, 64, (2, 8))
    out, ref = compiled(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert _ran_compiled(compiled)
    assert_close(out.loss, ref.loss, "loss")
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert_close(p.grad, q.grad, f"gradient of {name}")


def test_deepcopy_of_a_compiled_module_is_an_independent_compiled_module():
    """Before: TypeError (cannot pickle 'aotfuse._C.Program'), e.g. for an EMA copy of the model."""
    model = _net()
    compiled = aotfuse.memory_efficient_fusion(model, fallback="eager")
    x = torch.randn(2, 8)
    compiled(x)
    twin = copy.deepcopy(compiled)
    assert isinstance(twin, aotfuse.AOTModule) and twin.orig_module is not model
    assert twin._aotfuse_compiled.fallback == "eager"  # the options travel
    assert all(p is not q for p, q in zip(twin.parameters(), model.parameters()))
    assert_close(twin(x), model(x), "the copy's output")
    assert _ran_compiled(twin)
    with torch.no_grad():
        twin.fc2.weight.mul_(2)
    assert_close(compiled(x), model(x), "the original after changing the copy")
    assert_close(twin(x), twin.orig_module(x), "the changed copy")
    assert not torch.allclose(twin(x), model(x))


def _doubled(module, args, output):
    return output * 2


def test_torch_save_and_load_of_a_whole_compiled_module():
    """The module pickled as itself, compiled again when loaded; the compiled view's own hooks travel."""
    model = _net()
    compiled = aotfuse.memory_efficient_fusion(model)
    compiled.register_forward_hook(_doubled)
    x = torch.randn(2, 8)
    compiled(x)
    buf = io.BytesIO()
    torch.save(compiled, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, aotfuse.AOTModule)
    assert_close(loaded(x), model(x) * 2, "the loaded module's output, through its hook")
    assert _ran_compiled(loaded)
    assert list(loaded.state_dict()) == list(model.state_dict())


def test_deepcopy_of_a_compiled_function():
    def f(x, y):
        return (x * y).sin().sum()

    compiled = aotfuse.aot_function(f, fallback="eager")
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    compiled(x, y)
    twin = copy.deepcopy(compiled)
    assert twin.fallback == "eager" and twin.compile_count == 0
    assert_close(twin(x, y), f(x, y), "the copy's output")


def test_vmap_and_grad_over_compiled_functions_run_them_as_the_original():
    """Before: CaptureError ('Please convert all Tensors to FakeTensors')."""
    model = _net()
    compiled = aotfuse.memory_efficient_fusion(model)
    xs = torch.randn(3, 2, 8)
    with pytest.warns(UserWarning, match="torch.func transform"):
        out = torch.vmap(compiled)(xs)
    assert_close(out, torch.vmap(model)(xs), "vmap")

    def f(x):
        return (x.sin() * x).sum()

    cf = aotfuse.aot_function(f)
    x = torch.randn(5)
    with pytest.warns(UserWarning, match="torch.func transform"):
        g = torch.func.grad(cf)(x)
    assert_close(g, torch.func.grad(f)(x), "grad")
    assert_close(compiled(xs[0]), model(xs[0]), "a plain call afterwards")
    assert _ran_compiled(compiled)


def test_submodule_state_changed_after_compiling_is_not_ignored():
    """After the first compiled call: a batch norm frozen with .eval() inside a model that trains (a
    fine-tuning habit), a submodule replaced, inserted (Sequential.insert writes its dict directly)
    and deleted, a dropout's p raised. Each makes another signature, so the values stay eager's. Before, only the root's training flag was in the signature: the frozen norm
    kept normalizing with batch statistics and moving its running ones, the old submodule ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.GELU(), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(16, 8)

    def step(what):
        out, expected = compiled(x), ref(x)
        assert_close(out, expected, f"{what}: output")
        out.square().mean().backward()
        expected.square().mean().backward()
        assert_grads_match(model, ref, what)
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):  # batch norm's statistics: aotfuse's
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-7, msg=f"{what}: buffer {name}")  # own kernels' sums

    step("all training")
    model[1].eval()
    ref[1].eval()
    assert model.training and not model[1].training
    step("batch norm frozen by .eval()")
    model[2] = nn.Tanh()
    ref[2] = nn.Tanh()
    step("GELU replaced by Tanh")
    model.insert(3, nn.Linear(4, 4))  # Sequential.insert writes the submodule dict past the hooks
    ref.insert(3, copy.deepcopy(model[3]))
    step("a Linear inserted")
    del model[3], ref[3]
    step("the Linear deleted again")
    model.append(nn.Dropout(0.1))  # dropout draws differ from eager's: count the zeros
    x = torch.randn(256, 8)
    assert (compiled(x) == 0).float().mean().item() < 0.2
    model[-1].p = 0.9
    zeros = (compiled(x) == 0).float().mean().item()
    assert 0.8 < zeros, f"dropout p raised to 0.9 after compiling: {zeros:.2f} of the values dropped"


def test_a_compiled_module_inside_a_compiled_model_is_traced_through():
    """A user compiles a block, then the model holding it (or a Trainer compiles it again): the enclosing
    capture traces through the block (one program, the block's ops in it) and the block alone still runs
    its own. Before: CaptureError, the block's capture seeing the enclosing one's hook probe as a hook."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    model = nn.Sequential(aotfuse.memory_efficient_fusion(block), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    ref[0] = ref[0].orig_module
    ref64 = copy.deepcopy(ref).double()
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(4, 8)
    for step in range(2):
        out = compiled(x)
        assert_close(out, ref(x), f"step {step}: output")
        out.square().mean().backward()
        ref(x).square().mean().backward()
        ref64(x.double()).square().mean().backward()
        for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
            assert_close(p.grad, q.grad, f"step {step}: grad of {name}")
            err, eager_err = (p.grad.double() - r.grad).abs().max(), (q.grad.double() - r.grad).abs().max()
            assert err <= max(4 * eager_err, 1e-6), f"step {step}: grad of {name}: {err:.3g} from float64, eager {eager_err:.3g}"
    assert _ran_compiled(compiled) and compiled._aotfuse_compiled.compile_count == 1
    assert model[0]._aotfuse_compiled.compile_count == 0  # traced through, never compiled on its own
    assert_close(model[0](x), ref[0](x), "the block called alone")
    assert _ran_compiled(model[0])


def test_torch_compile_of_a_compiled_module_traces_it_through_without_a_warning():
    """torch.compile(memory_efficient_fusion(model)): Dynamo traces the view into the original module,
    which its backend compiles (here aotfuse's own). Before: the same, with a warning that the call was
    under a torch.func transform (Dynamo's trace looked like one)."""
    import warnings

    torch._dynamo.reset()
    model = _net()
    ref = copy.deepcopy(model)
    compiled = torch.compile(aotfuse.memory_efficient_fusion(model), backend="aotfuse")
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*aotfuse.*")
        out = compiled(x)
    assert_close(out, ref(x), "output")
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")


def test_a_function_registering_a_tensor_hook_is_refused_or_run_eagerly():
    seen = []

    def f(x):
        y = x.sin()
        y.register_hook(lambda g: seen.append(g.clone()))
        return (y * 2).sum()

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CaptureError, match="registers hooks"):
        aotfuse.aot_function(f)(x)
    compiled = aotfuse.aot_function(f, fallback="eager")
    seen.clear()
    with pytest.warns(UserWarning, match="could not capture"):
        compiled(x).backward()
    assert len(seen) == 1 and type(seen[0]) is torch.Tensor
    assert_close(seen[0], torch.full((4,), 2.0), "the hook's gradient")


@pytest.mark.parametrize("fallback", ["error", "eager"])
def test_a_kv_cache_argument_is_refused_or_run_eagerly(fallback):
    """transformers' DynamicCache is an object holding tensors, which the forward appends to: before,
    its tensors met the trace's fake ones (a confusing FakeTensor error)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    model.eval()
    compiled = aotfuse.memory_efficient_fusion(model, fallback=fallback)
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        out, ref = compiled(input_ids=ids, use_cache=True), model(input_ids=ids, use_cache=True)
        assert _ran_compiled(compiled)
        assert_close(out.logits, ref.logits, "logits")
        for k, (a, b) in enumerate(zip(out.past_key_values.layers, ref.past_key_values.layers)):
            assert type(a.keys) is torch.Tensor  # the output cache holds this call's tensors
            assert_close(a.keys, b.keys, f"cached keys of layer {k}")
        step = ids[:, -1:]
        if fallback == "error":
            with pytest.raises(CaptureError, match="DynamicCache holding tensors"):
                compiled(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            return
        with pytest.warns(UserWarning, match="could not capture"):
            nxt = compiled(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        assert_close(nxt.logits, model(input_ids=step, past_key_values=ref.past_key_values, use_cache=True).logits,
                     "the next token's logits")


def test_a_function_calling_a_hooked_module_is_refused_before_its_hook_runs():
    """aot_function over a function that calls a module (here one without parameters): its hooks are
    found when it is called while tracing, before they run."""
    act = nn.Tanh()
    seen = []
    act.register_forward_hook(lambda m, i, o: seen.append(o))

    def step(x, w):
        return act(x @ w).square().sum()

    x, w = torch.randn(2, 8), torch.randn(8, 4, requires_grad=True)
    with pytest.raises(CaptureError, match="Python hooks.*Tanh.forward_hooks"):
        aotfuse.aot_function(step)(x, w)
    assert seen == []  # stopped before the hook ran on traced tensors
    compiled = aotfuse.aot_function(step, fallback="eager")
    with pytest.warns(UserWarning, match="could not capture"):
        out = compiled(x, w)
    assert len(seen) == 1 and type(seen[0]) is torch.Tensor
    assert_close(out, step(x, w), "the loss")


class _StepSchedule(nn.Module):
    """A buffer the forward updates and then reads (a step counter feeding a schedule)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step += 1
        return (self.l(x) * (1.0 / self.step.sqrt())).tanh().sum()


class _ClampedWeight(nn.Module):
    """A parameter the forward clamps in place under no_grad, then uses."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.l.weight.clamp_(-0.3, 0.3)
        return self.l(x).relu().sum()


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("make", [_StepSchedule, _ClampedWeight])
def test_parameters_and_buffers_the_forward_updates_then_reads_train_like_eager(make, how):
    """The min cut saved such an input for the backward as free (parameters and buffers live anyway),
    but the forward's write-back changes it: the backward failed with autograd's 'modified by an
    inplace operation' (and a saved tensor without autograd's check would have held the new value).
    The cut now saves a copy made at the forward's start. Gradients as eager's and as float64's, over
    three steps with SGD updates."""
    torch.manual_seed(0)
    model = make()
    twin, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = aotfuse.memory_efficient_fusion(twin) if how == "memory_efficient_fusion" else \
        torch.compile(twin, backend="aotfuse")
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step), requires_grad=True)
        xr = x.detach().double().requires_grad_()
        compiled(x).backward()
        model(x.detach().requires_grad_()).backward()
        ref(xr).backward()
        for (name, p), q in zip(twin.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad.float(), f"{make.__name__} {how} step {step}: grad of {name} against float64",
                         atol=1e-5, rtol=1e-4)
        assert_close(x.grad, xr.grad.float(), f"{make.__name__} {how} step {step}: input grad against float64",
                     atol=1e-5, rtol=1e-4)
        for m in (twin, ref, model):  # an SGD step each, from each one's own gradients
            m.updates = [0.5 * p.grad.clone() for p in m.parameters()]
        assert_grads_match(twin, model, f"{make.__name__} {how} step {step}")
        for m in (twin, ref, model):
            with torch.no_grad():
                for p, u in zip(m.parameters(), m.updates):
                    p -= u
                    p.grad = None
    for (name, b), c in zip(twin.named_buffers(), model.named_buffers()):
        assert torch.equal(b, c[1]), name


class _ClassToken(nn.Module):
    """ViT's embeddings: a class token expanded over the batch, concatenated, plus position embeddings."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 5, 8))

    def forward(self, x):
        return (torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos).tanh().square().sum()


@pytest.mark.parametrize("how", ["memory_efficient_fusion", "torch.compile"])
def test_gradients_that_are_views_of_one_value_are_separate_tensors(how):
    """At batch size 1 the position embedding's gradient G needs no sum over the batch and the class
    token's is a slice of G: the backward returned views of one tensor, autograd kept them as the two
    .grad, and a second backward's in-place accumulation (or clip_grad_norm_) changed both. Found by a
    bug hunt on ViT, DeiT and BEiT with the Trainer at per-device batch 1 (torch's aot_eager and
    inductor backends do the same). Now separate tensors: two accumulated backwards and a clip as
    eager's and as float64's."""
    torch.manual_seed(0)
    model = _ClassToken()
    twin, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = aotfuse.memory_efficient_fusion(twin) if how == "memory_efficient_fusion" else \
        torch.compile(twin, backend="aotfuse")
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # accumulate
        compiled(x).backward()
        model(x).backward()
        ref(x.double()).backward()
    assert twin.cls.grad.untyped_storage().data_ptr() != twin.pos.grad.untyped_storage().data_ptr()
    for m in (twin, model, ref):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    for (name, p), q in zip(twin.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad.float(), f"{how}: accumulated, clipped grad of {name} against float64",
                     atol=1e-5, rtol=1e-4)
    assert_grads_match(twin, model, f"{how}: accumulated, clipped")


def test_lazy_modules_initialize_at_the_first_call_then_compile():
    """LazyLinear and LazyBatchNorm size their parameters at their first call: the signature of a call
    over uninitialized parameters raised torch's 'Can't access the shape of an uninitialized
    parameter'. The first call now runs eagerly (one warning) and initializes them, as eager's would;
    later calls compile, with eager's values, gradients and running statistics."""
    def make():
        return nn.Sequential(nn.LazyLinear(5), nn.LazyBatchNorm1d(), nn.Tanh(), nn.LazyLinear(2))

    torch.manual_seed(0)
    model, ref = make(), make()
    compiled = aotfuse.memory_efficient_fusion(model)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 3, generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(7)  # the lazy initializations draw the same numbers
            out = compiled(x)
        torch.manual_seed(7)
        expected = ref(x)
        lazy_warnings = [w for w in caught if "lazy modules" in str(w.message)]
        assert len(lazy_warnings) == (1 if step == 0 else 0), [str(w.message) for w in caught]
        out.sum().backward()
        expected.sum().backward()
        assert_close(out, expected, f"step {step}: output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"step {step}: grad of {name}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            assert_close(b, c, f"step {step}: buffer {name}")
    assert compiled._aotfuse_compiled.compile_count == 1


def test_parametrizations_under_their_cache_compile_and_leave_it_clean():
    """Inside torch.nn.utils.parametrize.cached(), tracing a parametrized weight (weight_norm) kept
    the first tracing pass's fake weight in torch's cache, and the next pass failed ('Mixing fake
    modes', a CaptureError blaming control flow). The trace now runs with the cache off: the program
    computes the weight from its parameters at each call, eager's values and gradients, and the
    cache holds only real tensors afterwards."""
    from torch.nn.utils import parametrizations, parametrize

    def make():
        torch.manual_seed(0)
        return nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 4)), nn.Tanh())

    model, ref = make(), make()
    compiled = aotfuse.memory_efficient_fusion(model)
    g = torch.Generator().manual_seed(2)
    for step in range(2):
        x = torch.randn(5, 4, generator=g)
        with parametrize.cached():
            out = compiled(x)
            weight = model[0].weight  # from the cache: a real tensor, the parametrization's value
            expected = ref(x)
            assert not isinstance(weight, torch._subclasses.FakeTensor)
            assert_close(weight, ref[0].weight, f"step {step}: cached weight")
        out.sum().backward()
        expected.sum().backward()
        assert_close(out, expected, f"step {step}: output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"step {step}: grad of {name}")
