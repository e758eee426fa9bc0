"""aotfuse/decisions.py: what a traced forward reads of its inputs' values (`.item()` of a mask, an
assert on the ids, `bool()` of a buffer) answered from the call's tensors while tracing and guarded
at every later call: a call answering otherwise runs a program traced for its answer."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse import decisions


def _agree(compiled, fn, *args):
    """compiled(*args) and fn(*args): the same outputs, and the same gradient of x (args[0])."""
    x = args[0]
    got, want = compiled(*args), fn(*args)
    torch.testing.assert_close(got, want)
    if x.requires_grad:
        g, = torch.autograd.grad(got.sum(), x)
        w, = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(g, w)


def _masks():
    none = torch.zeros(3, 5, dtype=torch.long)
    one = none.clone()
    one[1, 2] = 1
    return none, one


def test_a_branch_on_a_masks_item_is_traced_once_per_answer():
    def f(x, mask):
        if mask.flatten().any().item():
            return (x * 2).sin()
        return (x + 1).cos()

    compiled = aotfuse.aot_function(f)
    x = torch.randn(3, 5, requires_grad=True)
    none, one = _masks()
    for mask in (none, one, none, one, one.clone(), none.clone()):
        _agree(compiled, f, x, mask)
    assert compiled.compile_count == 2  # one program per answer, none traced again
    (rec,) = [r for r in compiled.records if r.decisions is not None and r.decisions.count == 1][:1]
    assert decisions.describe(rec.decisions, (0, True)).startswith("item() was ")


def test_a_comparison_guards_its_truth_not_the_value():
    """`assert lengths.max().item() <= slen` (XLM, Flaubert): every batch that fits runs one program."""
    def f(x, ids):
        lengths = (ids != 0).sum(dim=1)
        assert lengths.max().item() <= ids.shape[1]
        if lengths.min().item() > 2:
            return x * lengths[:, None]
        return x - lengths[:, None]

    compiled = aotfuse.aot_function(f)
    x = torch.randn(2, 4, requires_grad=True)
    ids = [torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]), torch.tensor([[1, 2, 3, 0], [5, 6, 7, 8]]),
           torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])]
    for i in ids:
        _agree(compiled, f, x, i)
    assert compiled.compile_count == 1  # max 4 and 3, min 3 and 4: the same truths
    short = torch.tensor([[1, 0, 0, 0], [5, 6, 7, 8]])  # min 1: the second comparison answers False
    _agree(compiled, f, x, short)
    assert compiled.compile_count == 2


def test_other_uses_of_a_number_guard_its_exact_value():
    def f(x, mask):
        n = mask.sum().item()
        return x[:, :n] * (n + 1)  # a size (__index__) and arithmetic

    compiled = aotfuse.aot_function(f)
    x = torch.randn(2, 6, requires_grad=True)
    m3, m4 = torch.tensor([1, 1, 1, 0, 0, 0]), torch.tensor([1, 1, 1, 1, 0, 0])
    for m in (m3, m4, m3, m4):
        _agree(compiled, f, x, m)
    assert compiled.compile_count == 2


@pytest.mark.parametrize("ask", ["bool", "equal", "contains", "float"])
def test_other_questions_are_answered_and_guarded(ask):
    def f(x, t):
        if ask == "bool":
            yes = bool(t.any())
        elif ask == "equal":
            yes = torch.equal(t, torch.ones_like(t))
        elif ask == "contains":
            yes = 1 in t
        else:
            yes = float(t.sum()) > 0.5
        return x * 3 if yes else x / 3

    compiled = aotfuse.aot_function(f)
    x = torch.randn(4, requires_grad=True)
    a, b = torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    for t in (a, b, a, b):
        _agree(compiled, f, x, t)
    assert compiled.compile_count == 2


def test_tolist_of_sizes_is_answered_and_guarded_exactly():
    """`.tolist()` (FunctionalTensor's own Python, past torch function modes: TAPAS's segment sizes, a
    `torch.split` by per-example sizes) is answered from the shadow and guarded by its whole value,
    and FunctionalTensor's method is its own again after the trace."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    before = FunctionalTensor.__dict__["tolist"]

    def f(x, sizes):
        parts = torch.split(x, sizes.tolist())
        return torch.cat([p.sin() * (i + 1) for i, p in enumerate(parts)])

    compiled = aotfuse.aot_function(f)
    x = torch.randn(6, requires_grad=True)
    a, b = torch.tensor([2, 4]), torch.tensor([3, 1, 2])
    for sizes in (a, b, a.clone(), b.clone()):
        _agree(compiled, f, x, sizes)
    assert compiled.compile_count == 2
    assert FunctionalTensor.__dict__["tolist"] is before


def test_a_write_into_a_fresh_tensor_is_replayed():
    """The steps a guard replays include in-place writes into tensors the forward made (a mask
    copy with its first column cleared): the answer is the one eager computes."""
    def f(x, mask):
        m = mask.clone()
        m[:, 0] = 0
        return x.exp() if m.any().item() else x.tanh()

    compiled = aotfuse.aot_function(f)
    x = torch.randn(2, 3, requires_grad=True)
    first_only = torch.tensor([[1, 0, 0], [1, 0, 0]])  # all cleared: False
    later = torch.tensor([[1, 0, 1], [0, 0, 0]])  # True
    for m in (first_only, later, first_only, later):
        _agree(compiled, f, x, m)
    assert compiled.compile_count == 2
    assert first_only[:, 0].tolist() == [1, 1]  # the caller's mask is not written by the replay


def test_a_modules_buffer_is_asked_again_at_each_call():
    class Switchable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("on", torch.tensor(1))

        def forward(self, x):
            y = self.lin(x)
            return y.relu() if self.on.item() else y.sigmoid()

    torch.manual_seed(0)
    model = Switchable()
    compiled = aotfuse.memory_efficient_fusion(model)
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), model(x))
    model.on.fill_(0)  # the caller changes the buffer in place: the guard reads it again
    torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    assert model.lin.weight.grad is not None
    assert compiled._aotfuse_compiled.compile_count == 2


def test_values_that_require_grad_random_draws_and_writes_into_inputs_are_not_answered():
    def on_activation(x, mask):
        return x * 2 if (x * mask).sum().item() > 0 else x

    def on_a_draw(x, mask):
        return x * 2 if (torch.rand(3) + mask).sum().item() > 1 else x

    def after_writing_the_input(x, mask):
        mask[0] = 1
        return x * 2 if mask.any().item() else x

    x, mask = torch.randn(3, requires_grad=True), torch.zeros(3)
    for f in (on_activation, on_a_draw, after_writing_the_input):
        rng = torch.get_rng_state()
        with pytest.raises(aotfuse.CaptureError, match="DataDependentOutputException"):
            aotfuse.aot_function(f)(x, mask.clone())
        assert torch.equal(torch.get_rng_state(), rng), f.__name__  # no draw made twice


def test_switched_off_a_question_is_a_capture_error(monkeypatch):
    monkeypatch.setenv("AOTFUSE_DECISIONS", "0")

    def f(x, mask):
        return x * 2 if mask.any().item() else x

    with pytest.raises(aotfuse.CaptureError, match="_local_scalar_dense"):
        aotfuse.aot_function(f)(torch.randn(3, requires_grad=True), torch.ones(3))


def test_answers_past_the_cache_limit_run_eagerly_with_one_warning():
    def f(x, mask):
        return x * mask.sum().item()

    compiled = aotfuse.aot_function(f, max_cache_size=2)
    x = torch.randn(6, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (1, 2, 3, 4, 5):  # five sums
            _agree(compiled, f, x, torch.arange(6) < n)
    said = [str(w.message) for w in caught if "other answers" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert compiled.compile_count == 3  # the first, and two other answers (the limit)


def _family_records(compiled):
    return [r for r in compiled.records if r.decisions is not None and r.decisions.sizes is not None]


def test_a_shape_family_answers_questions_and_each_shape_is_guarded():
    """A family's symbolic trace answers a question as a traced-alone shape would; each later shape
    runs the family's programs only where its own call answers alike (its first call included),
    and another answer gets a program traced for that shape."""
    def f(x, mask):
        return x.sin() if mask.all().item() else x.cos()

    compiled = aotfuse.aot_function(f, dynamic=True)
    for n, first_all in ((4, True), (6, True), (6, True), (8, False), (10, True)):
        x = torch.randn(n, requires_grad=True)
        every, some = torch.ones(n, dtype=torch.bool), torch.arange(n) < 2
        for mask in ((every, some) if first_all else (some, every)):
            _agree(compiled, f, x, mask)
    # the family (at 4), and for the other answer one program at each of 4, 6, 8 and 10
    assert compiled.compile_count == 5
    (family,) = compiled._families.values()
    assert not family.failed and family.record.decisions.count == 1


def test_a_familys_size_arguments_and_comparisons_are_made_numbers_for_each_shape():
    """Steps with symbolic sizes (`ids[:, :length - 1]`) and a comparison with a size (`< length - 1`)
    are replayed at each shape's own sizes: the truths differ between shapes and every call gets
    eager's values."""
    def f(x, ids):
        lengths = (ids != 0).sum(dim=1)
        assert lengths.max().item() <= ids.shape[1]  # XLM's and Flaubert's assert: true at every length
        short = lengths.max().item() < ids.shape[1] - 1
        tail = ids[:, : ids.shape[1] - 1].any().item()
        if short and tail:
            return x * lengths[:, None]
        return x - lengths[:, None] if tail else x + 1

    compiled = aotfuse.aot_function(f)
    seen = {}
    for length in (5, 6, 7, 9, 7, 12):
        x = torch.randn(2, length, requires_grad=True)
        full = torch.ones(2, length, dtype=torch.long)  # not short
        part = full.clone()
        part[:, -3:] = 0  # short
        for ids in (part, full):
            _agree(compiled, f, x, ids)
        seen.setdefault(length, compiled.compile_count)
    (family,) = compiled._families.values()
    assert not family.failed
    (rec,) = _family_records(compiled)
    assert rec is family.record and rec.decisions.count == 3
    assert len(rec.decisions._at) >= 3  # the steps made numbers once per shape (6, 7, 9, 12)
    # 5: two traces; 6: the family and the other answer; 7, 9 and 12: the other answer only
    assert [seen[n] for n in (5, 6, 7, 9, 12)] == [2, 4, 5, 6, 7]
    assert compiled.compile_count == 7  # the second visit to 7 traced nothing


def test_under_torch_compile_dynamo_still_splits():
    """torch.compile(backend="aotfuse") is unchanged: Dynamo breaks the graph at the .item()."""
    def f(x, mask):
        return x * 2 if mask.any().item() else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotfuse")
    x = torch.randn(3, requires_grad=True)
    for m in (torch.zeros(3), torch.ones(3)):
        _agree(compiled, f, x, m)
    torch._dynamo.reset()


def test_a_0d_tensor_where_a_number_goes_is_its_guarded_value():
    """Funnel's `torch.arange(max_dist, min_dist - 1, -stride)` of 0-d tensors made from positions:
    ATen reads their values, so the trace takes them (exactly guarded) where it had to."""
    def f(x, mask):
        count = mask.sum()
        idx = torch.arange(count - 1, -1, -1, dtype=torch.long)  # the first `count` columns, reversed
        return x[:, idx] * 2

    compiled = aotfuse.aot_function(f)
    x = torch.randn(2, 5, requires_grad=True)
    three, three_too, four = torch.tensor([1, 1, 1, 0, 0]), torch.tensor([0, 1, 1, 1, 0]), torch.tensor([1, 1, 1, 1, 0])
    for m in (three, three_too, four, three):
        _agree(compiled, f, x, m)
    assert compiled.compile_count == 2


def test_a_familys_0d_tensor_where_a_number_goes_is_its_guarded_value():
    """In a family's symbolic trace ATen would read such a 0-d tensor as a new unbacked symbol (no
    error to answer): its value goes in first, exactly guarded, and shapes with that value join."""
    def f(x, mask):
        count = mask.sum()
        idx = torch.arange(count - 1, -1, -1, dtype=torch.long)
        # a size and a fill value too (the first mask element: 1 at every length)
        return x[:, idx] * 2 + torch.zeros(count) + torch.full((1,), mask[0] * 0.5)

    compiled = aotfuse.aot_function(f, dynamic=True)
    seen = []
    for n, ones in ((5, 3), (6, 3), (7, 3), (7, 4), (8, 3)):
        x = torch.randn(2, n, requires_grad=True)
        _agree(compiled, f, x, (torch.arange(n) < ones).long())
        seen.append(compiled.compile_count)
    (family,) = compiled._families.values()
    assert not family.failed and family.record.decisions.count == 3
    assert seen == [1, 1, 1, 2, 2], seen  # 6, 7 and 8 with three ones join the family; four ones: traced


def test_a_family_deciding_on_a_value_made_from_its_sizes_fails_at_once(monkeypatch):
    """A value worked out from a symbolic size (Funnel's relative positions, `arange(length)[-1] + 1`)
    read exactly would make the family's trace one shape's: the family fails in its trace, each
    shape is traced on its own, and every call gets eager's values."""
    def f(x, ids):
        last = torch.arange(ids.shape[1])[-1] + 1  # the length, as a 0-d tensor
        idx = torch.arange(last - 1, -1, -1)
        return x[:, idx] * (ids != 0)

    said = []
    monkeypatch.setattr(aotfuse.config, "emit", lambda stage, message: said.append(message))
    compiled = aotfuse.aot_function(f, dynamic=True)
    for n in (5, 6, 7, 6):
        _agree(compiled, f, torch.randn(2, n, requires_grad=True), torch.randint(0, 3, (2, n)))
    (family,) = compiled._families.values()
    assert family.failed
    assert compiled.compile_count == 3  # 5, 6 and 7 each traced on its own; 6 again traced nothing
    failed = [m for m in said if "no symbolic trace" in m]
    assert len(failed) == 1 and "SizeDependentDecision" in failed[0] and "(4)" in failed[0], said  # length 5: `last - 1`


def test_a_familys_value_mixed_from_sizes_and_data_keeps_the_family():
    """A value read exactly that mixes the sizes with the inputs' values (how many positions fall
    within each row's length: the same number at every length past the longest row) keeps the
    family: later lengths with that answer join it."""
    def f(x, lengths):
        within = int((torch.arange(x.shape[1])[None] < lengths[:, None]).sum())
        return x * within

    compiled = aotfuse.aot_function(f, dynamic=True)
    lengths = torch.tensor([3, 4])
    for n in (5, 6, 7, 8):
        _agree(compiled, f, torch.randn(2, n, requires_grad=True), lengths)
    (family,) = compiled._families.values()
    assert not family.failed and family.record.decisions.count == 1
    assert compiled.compile_count == 1  # 6, 7 and 8 answer 7 too: members, nothing traced


def _masked(x, ids):
    """Data-dependent shapes of masks made from the ids: a mask indexing and assigning (X-MOD's
    adapters), the audio LMs' `logits[..., :-1, :][mask]`, nonzero, where(cond), masked_select."""
    m = ids != 0
    picked = x[m] * 2  # [count, 4]
    z = torch.zeros_like(x)
    z[m] = picked.sin()
    shifted = x[..., :-1, :][m[:, 1:]]
    both = x[:, m[0]]  # a mask of dim 1's size after a slice
    sel = torch.masked_select(x, (ids > 2)[..., None])
    rows, cols = torch.where(ids > 1)
    return (z.sum() + picked.pow(2).sum() + shifted.tanh().sum() + both.exp().sum() + sel.cos().sum()
            + x[rows, cols].sum() + torch.nonzero(ids > 1).sum() + torch.argwhere(m).float().mean())


def test_masks_of_the_inputs_index_in_one_graph_guarded_by_their_counts():
    """Boolean masks of non-grad inputs (ids, masks) give shapes that depend on their values: each
    nonzero count is answered and guarded, the trace takes nonzero_static at that count; gradients
    through the indexed tensor are eager's and float64's; a call whose counts differ runs another
    program, one with the same counts and other positions the same program."""
    compiled = aotfuse.aot_function(_masked)  # fallback="error": a capture error would raise
    x = torch.randn(3, 5, 4, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3, 0], [3, 3, 0, 1, 2], [1, 0, 0, 2, 3]])
    _agree(compiled, _masked, x, ids)
    x64 = x.detach().double().requires_grad_()
    g, = torch.autograd.grad(compiled(x, ids), x)
    g64, = torch.autograd.grad(_masked(x64, ids), x64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-5)
    (rec,) = compiled.records
    assert rec.decisions is not None and len(rec.decisions.counts) >= 5
    ran = rec.programs["forward"].extern_counts()
    assert ran.get("aten::nonzero_static.default", 0) >= 5 and "aten::nonzero.default" not in ran, ran
    same_counts = ids[:, [1, 0, 2, 4, 3]]  # each row's values moved: the counts are the same
    _agree(compiled, _masked, x, same_counts)
    assert compiled.compile_count == 1
    other = ids.clone()
    other[0, 0] = 2  # one more nonzero
    _agree(compiled, _masked, x, other)
    assert compiled.compile_count == 2
    _agree(compiled, _masked, x, ids)
    assert compiled.compile_count == 2


def test_a_mask_count_that_keeps_changing_runs_the_fallback_past_two_others():
    """Padding masks change their counts at every batch: past two programs traced for other counts,
    a function with fallback="dynamo" runs the rest under Dynamo (its graph break at the shape);
    with the default fallback ("error") each count is traced up to the cache limit."""
    def f(x, mask):
        return (x[mask != 0] * 3).sin().sum()

    x = torch.randn(2, 8, requires_grad=True)
    masks = [(torch.arange(8) < n).long().expand(2, 8) for n in (8, 7, 6, 5, 4, 7)]
    compiled = aotfuse.aot_function(f, fallback="dynamo")
    for n, mask in enumerate(masks):
        _agree(compiled, f, x, mask)
        assert (compiled.last_entry is None) == (n in (3, 4)), n  # counts 10 and 8: the fallback ran
    assert compiled.compile_count == 3
    plain = aotfuse.aot_function(f)
    for mask in masks:
        _agree(plain, f, x, mask)
    assert plain.compile_count == 5


def test_masks_not_answered_stay_capture_errors_and_a_mismatched_mask_raises():
    """A mask of values that require grad (`x[x > 0]`) has no shadow: a capture error as before; a
    mask whose sizes are not the indexed dimensions' raises as eager does, never indexes silently."""
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(aotfuse.CaptureError, match="nonzero"):
        aotfuse.aot_function(lambda x: x[x > 0].sum())(x)

    def wrong(x, ids):
        return x[ids != 0].sum()

    ids = torch.ones(3, 3, dtype=torch.long)
    with pytest.raises(IndexError):
        wrong(x, ids)
    with pytest.raises((aotfuse.CaptureError, IndexError)):
        aotfuse.aot_function(wrong)(x, ids)


def test_an_assignment_through_a_mask_that_needs_no_positions_is_not_guarded():
    """`x[mask] = 0.0` (and a 0-d or one-element value that needs no gradient) is ATen's masked fill:
    its shape does not depend on the mask, so it is traced as it is, with no count to guard; a value
    that requires grad is read back at the mask's positions by the backward, and is counted."""
    def fill(x, ids):
        z = x * 2
        z[ids != 0] = 0.5
        z[ids == 2] = torch.tensor(3.0)
        return z.pow(2).sum()

    def from_grad(x, ids):
        z = x * 2
        z[ids != 0] = x.sum()
        return z.pow(2).sum()

    x, ids = torch.randn(3, 5, requires_grad=True), torch.tensor([[0, 1, 2, 0, 1]] * 3)
    for f, guarded in ((fill, False), (from_grad, True)):
        compiled = aotfuse.aot_function(f)
        _agree(compiled, f, x, ids)
        assert (compiled.records[0].decisions is not None) == guarded, f.__name__


def test_switched_off_a_mask_index_is_a_capture_error(monkeypatch):
    monkeypatch.setenv("AOTFUSE_DECISIONS", "0")
    with pytest.raises(aotfuse.CaptureError, match="nonzero"):
        aotfuse.aot_function(lambda x, ids: x[ids != 0].sum())(torch.randn(3, requires_grad=True), torch.ones(3))


def test_the_same_steps_asked_again_are_recorded_once_and_writes_stay_exact():
    """Each layer asking the same questions of the same mask (Longformer's layers) records the steps
    once: the guard replays them once a call. Writes keep every answer exact: a tensor written after
    an equal one was made (two `zeros_like(ids)`, two `ids.clone()`) gets a copy of its own first;
    an in-place op whose name does not say so (`F.relu(h, inplace=True)`) makes later questions about
    h be asked again; constants are told apart by their bits (0.0 and -0.0)."""
    def layers(x, ids):
        for _ in range(6):
            m = ids != 0
            if m.sum().item() > 3:
                x = x * m.sum(1, keepdim=True)
            x = x + x[m].sum()
        return x

    compiled = aotfuse.aot_function(layers)
    x, ids = torch.randn(2, 5, requires_grad=True), torch.tensor([[0, 1, 2, 0, 1], [3, 0, 0, 1, 2]])
    _agree(compiled, layers, x, ids)
    d = compiled.records[0].decisions
    assert d.count == 2 and len(d.counts) == 1 and len(d.steps) <= 5, (d, [decisions._name(s.func) for s in d.steps])

    def fresh(x, ids):
        a, b = torch.zeros(3), torch.zeros(3)
        a[0] = 1.0
        return x * 2 if b.sum().item() == 0 else x

    def copies(x, ids):
        pos, types = torch.zeros_like(ids), torch.zeros_like(ids)
        pos[:, 1:] = 1
        labels, keep = ids.clone(), ids.clone()
        labels[labels == 0] = -100
        types[0] = 2
        n = int((labels == -100).sum()) + int(keep.sum()) * 10
        return x * (pos.sum() + types.sum() * 100).item() + n

    def relu_in_place(x, ids):
        h = ids.float() - 1.5
        n1 = (h < 0).sum().item()
        torch.nn.functional.relu(h.view(-1), inplace=True)
        return x * (n1 + 10 * (h < 0).sum().item())

    def add_in_place_twice(x, ids):  # an in-place op whose name does not say so, twice
        h = ids.float() - 1.5
        for _ in range(2):
            torch.ops.aten.add_.Tensor(h.view(-1), 1.0)
        return x * (h < 1).sum().item()

    def signed_zero(x, ids):
        a, b = ids.float().mul(0.0), ids.float().mul(-0.0)
        return x * 2 if (1 / b).min().item() < 0 and (1 / a).min().item() > 0 else x * 3

    for f in (fresh, copies, relu_in_place, add_in_place_twice, signed_zero):
        compiled = aotfuse.aot_function(f)
        _agree(compiled, f, x, ids)
        _agree(compiled, f, x, ids.flip(1))
        assert compiled.compile_count == 1, f.__name__


@pytest.mark.parametrize("view", [lambda h, x: h.view_as(x), lambda h, x: h.view_as(x).mT[0],
                                  lambda h, x: h.expand_as(x)[..., None]], ids=["view_as", "mT_select", "expand_index"])
def test_a_write_through_a_view_made_beside_an_activation_ends_the_answers(view):
    """`h.view_as(x)` (x requires grad) is a view of h with no shadow; a write through it, or through a
    view of it, changes h, so a later question about h cannot be answered from h's shadow: a capture
    error, not the stale answer it was (the review's finding, at 485f844 too)."""
    def f(x, ids):
        h = ids.float()
        v = view(h, x)
        v.zero_()
        return x * h.sum().item()

    x, ids = torch.randn(2, 2, requires_grad=True), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(aotfuse.CaptureError, match="DataDependentOutputException"):
        aotfuse.aot_function(f)(x, ids)


def test_a_write_into_a_copy_made_beside_an_activation_keeps_the_answers():
    """Only views are remembered: a new tensor made from h and an activation can be written freely,
    and h's question is still answered and guarded (one program, equal to eager)."""
    def f(x, ids):
        h = ids.float()
        c = torch.where(x.detach() > 0, h, x.detach())
        c.zero_()
        return x * h.sum().item() + c

    x, ids = torch.randn(2, 2, requires_grad=True), torch.tensor([[0, 1], [2, 3]])
    compiled = aotfuse.aot_function(f)
    torch.testing.assert_close(compiled(x, ids), f(x, ids))
    torch.testing.assert_close(compiled(x, ids + 1), f(x, ids + 1))
    assert compiled.compile_count == 2


def test_a_0d_mask_in_an_index_is_never_read_as_a_number():
    """A 0-d uint8 or bool tensor in an index is a mask (eager adds a dimension); a 0-d integer tensor
    is that integer, guarded exactly."""
    x, ids = torch.randn(3, 4, requires_grad=True), torch.tensor([1, 0, 0])

    def by_byte(x, ids):
        return x[(ids[0] != 0).to(torch.uint8)] * 2

    assert by_byte(x, ids).shape == (1, 3, 4)
    with pytest.raises(aotfuse.CaptureError):
        aotfuse.aot_function(by_byte)(x, ids)

    def by_int(x, ids):
        return x[ids != 0, ids[0] + 1] * 2

    compiled = aotfuse.aot_function(by_int)
    _agree(compiled, by_int, x, ids)
    _agree(compiled, by_int, x, torch.tensor([2, 1, 0]))
    assert compiled.compile_count == 2
