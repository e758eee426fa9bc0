"""Channels-last convolutions on the CPU (decompositions.py, "channels-last convolutions"): a forward
convolution of a contiguous NCHW input runs on a channels-last copy, the layout flows through the
network, the outputs get eager's strides back, and what that layout would change (a view it cannot
take, a copy where eager has a view, as_strided, a view output) is traced again without it."""
import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing import compare_models

aten = torch.ops.aten
CL = torch.channels_last


def _flagged(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=CL)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.short(x))


class SmallResNet(nn.Module):
    """A ResNet's shape: 7x7 stem, batch norm, ReLU, max pool, two residual blocks, average pool, linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(_Block(16, 16), _Block(16, 32, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def _graphs(compiled) -> dict:
    return compiled._aotfuse_compiled.last_entry.record.graphs


def _conv_inputs(gm: torch.fx.GraphModule, target) -> list[torch.Tensor]:
    return [n.args[0 if target == aten.convolution.default else 1].meta["val"]
            for n in gm.graph.nodes if n.target == target]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_cnn_runs_its_convolutions_channels_last_and_trains_like_eager_and_float64(dtype):
    kept = []

    def keep(model):
        kept.append(aotfuse.memory_efficient_fusion(model))
        return kept[-1]

    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    compare_models(SmallResNet, x, dtype=dtype, steps=2, compile_fn=keep).assert_ok()
    graphs = _graphs(kept[0])
    convs = _conv_inputs(graphs["forward"], aten.convolution.default)
    assert len(convs) == 6 and all(_flagged(t) for t in convs), [t.stride() for t in convs]
    # the backward's convolutions too (the stem's input copy is the forward's, saved or recomputed)
    back = _conv_inputs(graphs["backward"], aten.convolution_backward.default)
    assert len(back) == 6 and all(_flagged(t) for t in back), [t.stride() for t in back]
    # no convolution input is copied but the network's input, and no copy back to NCHW is made
    formats = [n.kwargs.get("memory_format") for n in graphs["forward"].graph.nodes if n.target == aten.clone.default]
    assert [f for f in formats if f is not None] == [CL], formats
    assert not kept[0]._aotfuse_compiled._layout_off


def test_outputs_keep_eagers_strides_in_training_and_without_grad():
    """A feature map returned beside the logits: channels-last inside the trace, eager's NCHW out."""

    class Features(SmallResNet):
        def forward(self, x):
            f = self.blocks(self.stem(x))
            return self.head(f), f

    torch.manual_seed(0)
    model = Features()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x = torch.randn(4, 3, 32, 32)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            ref, ours = model(x), compiled(x)
        for r, o in zip(ref, ours):
            assert o.stride() == r.stride(), (grad, o.stride(), r.stride())
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
        stage = "forward" if grad else "inference"
        assert any(_flagged(t) for t in _conv_inputs(_graphs(compiled)[stage], aten.convolution.default)), stage


def test_the_switch_keeps_the_traced_layout(monkeypatch):
    monkeypatch.setenv("AOTFUSE_CHANNELS_LAST_CONVS", "0")
    torch.manual_seed(0)
    model = SmallResNet()
    compiled = aotfuse.memory_efficient_fusion(copy.deepcopy(model))
    x = torch.randn(2, 3, 32, 32)
    compiled(x).sum().backward()
    convs = _conv_inputs(_graphs(compiled)["forward"], aten.convolution.default)
    assert convs and not any(_flagged(t) for t in convs)


class _Edge(nn.Module):
    """A convolution's output, then what the channels-last layout could change."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.c1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)  # (a bias before a batch norm: its gradient is 0)
        self.bn, self.c2 = nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = self.c2(h) + h
        m = self.mode
        if m == "feature-map":
            return h.mean(), h
        if m == "view":  # not a view of a channels-last tensor: the trace fails
            return h.view(h.shape[0], -1).sum(1)
        if m == "reshape-in-place":  # a view in eager: the write reaches h
            y = h.reshape(h.shape[0], -1)
            y.mul_(2)
            return h.sum() + y.sum()
        if m == "contiguous-in-place":
            y = h.contiguous()
            y.add_(1)
            return h * 3
        if m == "as-strided":  # its values depend on the layout
            return h.as_strided((2, 5), (3, 1)) * 1
        if m == "twice":  # one tensor, two outputs: still one
            return h, h, h.sum()
        if m == "view-output":
            return h[0], h
        if m == "permuted-output":  # eager's strides are neither NCHW's nor channels-last's
            return h.permute(0, 2, 3, 1) * 1
        if m == "flatten-transpose":  # a view in both layouts (ViT's patch embedding)
            return h.flatten(2).transpose(1, 2).sum(-1)
        if m == "overlapping-view-output":  # the call makes it from its base, which the graph returns
            return h.unfold(3, 3, 1), h.sum()
        raise ValueError(m)


# mode -> whether it is traced again without the layout
_EDGES = {"feature-map": False, "view": True, "reshape-in-place": True, "contiguous-in-place": True,
          "as-strided": True, "twice": False, "view-output": True, "permuted-output": True,
          "flatten-transpose": False, "overlapping-view-output": True}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["memory_efficient_fusion", "torch.compile"])
@pytest.mark.parametrize("mode", list(_EDGES))
def test_what_the_layout_would_change_is_traced_again_without_it(mode, backend, monkeypatch):
    """Values and gradients within 4x eager's distance from float64 (+1e-6), and each output's
    strides, and which outputs share memory, as eager's; the layout was tried (under both backends)."""
    import aotfuse.decompositions as decompositions

    fired = []
    conv = decompositions._convolution_channels_last

    def counted(*args):
        out = conv(*args)
        fired.append(out is not NotImplemented)
        return out

    monkeypatch.setattr(decompositions, "_convolution_channels_last", counted)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Edge(mode)
    r64 = copy.deepcopy(model).double()
    compiled = (aotfuse.memory_efficient_fusion(copy.deepcopy(model)) if backend == "memory_efficient_fusion"
                else torch.compile(copy.deepcopy(model), backend="aotfuse"))
    x = torch.randn(4, 3, 10, 10)
    outs = {}
    for name, f, xin in (("eager", model, x), ("ours", compiled, x), ("f64", r64, x.double())):
        xin = xin.clone().requires_grad_()
        o = f(xin)
        o = o if isinstance(o, tuple) else (o,)
        sum((t.double() * (k + 1)).sum() for k, t in enumerate(o)).backward()
        outs[name] = (o, xin.grad, [p.grad for p in (f.parameters() if isinstance(f, nn.Module) else ())])
    (eo, ex, eg), (oo, ox, og), (ro, rx, rg) = outs["eager"], outs["ours"], outs["f64"]
    assert [t.stride() for t in oo] == [t.stride() for t in eo]
    def shared(o):
        return [[a.data_ptr() == b.data_ptr() for b in o] for a in o]

    assert shared(oo) == shared(eo), (shared(oo), shared(eo))
    pairs = [(f"output {k}", a, b, c) for k, (a, b, c) in enumerate(zip(oo, eo, ro))]
    pairs += [("input's gradient", ox, ex, rx)]
    pairs += [(f"gradient {k}", a, b, c) for k, (a, b, c) in enumerate(zip(og, eg, rg))]
    for what, ours, eager, ref in pairs:
        assert ours.stride() == eager.stride() or what.startswith("gradient"), (what, ours.stride(), eager.stride())
        assert _rel(ours, ref.detach()) <= 4 * _rel(eager, ref.detach()) + 1e-6, (mode, what)
    assert any(fired), mode
    if backend == "memory_efficient_fusion":
        assert compiled._aotfuse_compiled._layout_off == _EDGES[mode], mode
