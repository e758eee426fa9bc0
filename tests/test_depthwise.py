"""Depthwise convolutions' weight gradient on the CPU (decompositions.py, "depthwise convolutions' weight
gradient"): kh x kw fused column sums over slices of the padded input instead of ATen's (oneDNN's)
convolution_backward, whose input gradient is still ATen's, asked for alone."""
import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing import compare_models

aten = torch.ops.aten


class ConvNeXtish(nn.Module):
    """ConvNeXt's block shape: a 7x7 depthwise convolution with bias (padding 3), a channels-last layer
    norm between pointwise linears, GELU, a residual add; a patchify stem and a strided downsample."""

    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, 4)
        self.dw1, self.dw2 = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.Conv2d(2 * c, 2 * c, 7, padding=3, groups=2 * c)
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(2 * c)
        self.mlp1 = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
        self.mlp2 = nn.Sequential(nn.Linear(2 * c, 4 * c), nn.GELU(), nn.Linear(4 * c, 2 * c))
        self.down = nn.Conv2d(c, 2 * c, 2, 2)
        self.head = nn.Linear(2 * c, classes)

    def block(self, x, dw, norm, mlp):
        y = dw(x).permute(0, 2, 3, 1)
        return x + mlp(norm(y)).permute(0, 3, 1, 2)

    def forward(self, x):
        x = self.block(self.stem(x), self.dw1, self.norm1, self.mlp1)
        x = self.block(self.down(x), self.dw2, self.norm2, self.mlp2)
        return self.head(x.mean((2, 3)))


class MobileNetish(nn.Module):
    """EfficientNet's and MobileNet's depthwise shapes: 5x5 stride 2 without bias, a dilated 5x5, a 3x5
    with uneven padding, each between pointwise convolutions, batch norms and ReLU6; the first
    convolution depthwise too (5x5, on the network's NCHW input), and a 3x3, which stays oneDNN's."""

    def __init__(self, c: int = 8, classes: int = 10):
        super().__init__()
        self.first = nn.Conv2d(3, 3, 5, padding=2, groups=3)  # depthwise on the network's NCHW input
        self.expand = nn.Conv2d(3, c, 1)
        self.dw_s2 = nn.Conv2d(c, c, 5, stride=2, padding="valid", groups=c, bias=False)  # as EfficientNet's
        self.bn = nn.BatchNorm2d(c)
        self.dw_dil = nn.Conv2d(c, c, 5, padding=4, dilation=2, groups=c)
        self.dw_rect = nn.Conv2d(c, c, (3, 5), padding=(1, 2), groups=c)
        self.dw_3x3 = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.project = nn.Conv2d(c, c, 1)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.expand(self.first(x))
        x = nn.functional.relu6(self.bn(self.dw_s2(x)))
        x = nn.functional.relu6(self.dw_dil(x)) + x
        x = self.project(self.dw_3x3(self.dw_rect(x)))
        return self.head(x.mean((2, 3)))


def _backward_convs(compiled) -> list:
    gm = compiled._aotfuse_compiled.last_entry.record.graphs["backward"]
    return [n for n in gm.graph.nodes if n.target == aten.convolution_backward.default]


def _transposed_f32(compiled) -> list:
    """The backward's float32 transposed convolutions (a strided 16-bit depthwise input gradient)."""
    gm = compiled._aotfuse_compiled.last_entry.record.graphs["backward"]
    return [n for n in gm.graph.nodes if n.target == aten.convolution.default and n.args[6]
            and n.meta["val"].dtype == torch.float32]


def _depthwise(node) -> bool:
    """A depthwise convolution the sums take (more than 3x3)."""
    w = node.args[2].meta["val"]
    return node.args[9] > 1 and w.shape[1] == 1 and w.shape[0] == node.args[9] and w.shape[2] * w.shape[3] > 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [ConvNeXtish, MobileNetish], ids=["convnext", "mobilenet"])
def test_depthwise_weight_gradients_are_fused_sums_and_train_like_eager_and_float64(model, dtype, monkeypatch):
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")  # bf16 kernels as such: on CPUs without AVX-512 (no fast
    # bf16 matmuls) the default computes matmuls in float32, whose programs differ (tests/test_float32_compute.py)
    kept = {}

    def keep(flag):
        def compile_fn(m):
            monkeypatch.setenv("AOTFUSE_DEPTHWISE_GRADS", flag)
            kept[flag] = aotfuse.memory_efficient_fusion(m)
            return kept[flag]
        return compile_fn

    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    compare_models(model, x, dtype=dtype, steps=2, compile_fn=keep("1")).assert_ok()
    convs = _backward_convs(kept["1"])
    depthwise = [n for n in convs if _depthwise(n)]
    # MobileNetish's first convolution (of the input, which needs no gradient) has no ATen call left, nor
    # in bf16 its strided 5x5 (the input's gradient a float32 transposed convolution)
    want = {ConvNeXtish: 2, MobileNetish: 3 if dtype == torch.float32 else 2}[model]
    assert len(depthwise) == want, [n.args[9] for n in convs]
    assert len(_transposed_f32(kept["1"])) == (model is MobileNetish and dtype == torch.bfloat16)
    assert all(n.args[9] != 3 for n in convs), [n.args[9] for n in convs]
    # ATen computes the input's gradient alone (the first convolution's none: the input needs none)
    assert all(list(n.args[10])[1:] == [False, False] for n in depthwise), [n.args[10] for n in depthwise]
    assert all(list(n.args[10])[1] for n in convs if not _depthwise(n)), [n.args[10] for n in convs]
    compare_models(model, x, dtype=dtype, steps=1, compile_fn=keep("0")).assert_ok()
    assert all(list(n.args[10])[1] for n in _backward_convs(kept["0"])), "AOTFUSE_DEPTHWISE_GRADS=0 kept ATen's"


@pytest.mark.parametrize("conv", [
    nn.Conv2d(8, 8, 3, padding=1),                  # groups 1
    nn.Conv2d(8, 8, 3, padding=1, groups=2),        # grouped, not depthwise
    nn.Conv2d(8, 16, 3, padding=1, groups=8),       # two filters a channel
    nn.Conv2d(8, 8, 9, padding=4, groups=8),        # 81 taps
    nn.Conv2d(8, 8, 3, padding=1, groups=8),        # 3x3: oneDNN's is quicker
], ids=["dense", "grouped", "multiplier-2", "9x9", "3x3"])
def test_other_convolutions_keep_atens_backward(conv):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12)
    compiled = aotfuse.memory_efficient_fusion(conv)
    out = compiled(x)
    out.square().sum().backward()
    ref = conv.weight.grad.clone()
    conv.weight.grad = None
    conv(x).square().sum().backward()
    torch.testing.assert_close(ref, conv.weight.grad, rtol=1e-4, atol=1e-4)
    convs = _backward_convs(compiled)
    assert len(convs) == 1 and list(convs[0].args[10])[1], [n.args[10] for n in convs]


def test_depthwise_weight_gradient_matches_float64_as_well_as_eagers():
    """The fused sums against float64 (ConvNeXt's last stage, where oneDNN's took 1.7 ms and 19 MB)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 7, padding=3, groups=64).to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(8, 64, 2, 2).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    g = torch.randn(8, 64, 2, 2).to(torch.bfloat16)
    compiled = aotfuse.memory_efficient_fusion(conv)
    (compiled(x) * g).sum().backward()
    ours = conv.weight.grad.clone(), conv.bias.grad.clone()
    conv.weight.grad = conv.bias.grad = None
    (conv(x) * g).sum().backward()
    eager = conv.weight.grad, conv.bias.grad
    c64 = nn.Conv2d(64, 64, 7, padding=3, groups=64).double()
    c64.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
    (c64(x.double()) * g.double()).sum().backward()
    for got, want, exact, name in zip(ours, eager, (c64.weight.grad, c64.bias.grad), ("weight", "bias")):
        far, eager_far = (got.double() - exact).abs().max().item(), (want.double() - exact).abs().max().item()
        assert far <= max(eager_far, 1e-6) * 1.01, (name, far, eager_far)


def test_under_torch_compile_the_weight_gradient_is_the_fused_sums_too(monkeypatch):
    from aotfuse import decompositions

    decomposed = []
    first = decompositions._depthwise_backward

    def counted(*args):
        out = first(*args)
        decomposed.append(out is not NotImplemented)
        return out

    monkeypatch.setattr(decompositions, "_depthwise_backward", counted)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MobileNetish()
    ref = MobileNetish()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    compiled = torch.compile(model, backend="aotfuse")
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert decomposed.count(True) == 4, decomposed  # the four depthwise convolutions above 3x3'


@pytest.mark.parametrize("env", [{"AOTFUSE_FUSION": "0"}, {"AOTFUSE_BACKEND": "cuda"}], ids=["no-kernels", "cuda-only"])
def test_without_cpu_kernels_the_backward_stays_atens(env, monkeypatch):
    """Decomposed, the weight gradient would be 49 products and sums as separate ATen calls."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 7, padding=3, groups=8)
    x = torch.randn(2, 8, 6, 6)
    compiled = aotfuse.memory_efficient_fusion(conv)
    compiled(x).square().sum().backward()
    convs = _backward_convs(compiled)
    assert len(convs) == 1 and list(convs[0].args[10])[1], [n.args[10] for n in convs]


class TFPadded(nn.Module):
    """MobileNetV2's (Hugging Face, tf_padding) strided depthwise layers: an explicit (0, 1, 0, 1) pad
    then a 3x3 stride-2 convolution without padding; beside it a PyTorch-padded 3x3 stride 2 with bias
    and a 5x5 stride 2."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.tf = nn.Conv2d(c, c, 3, stride=2, groups=c, bias=False)
        self.torch = nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c)
        self.five = nn.Conv2d(c, c, 5, stride=2, padding=2, groups=c, bias=False)

    def forward(self, x):
        a = self.tf(nn.functional.pad(nn.functional.relu6(x), (0, 1, 0, 1)))
        return a * self.torch(x) + self.five(x)


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_strided_16bit_depthwise_input_gradient_is_float32s(dtype, layout, monkeypatch):
    """A strided bf16/fp16 depthwise convolution's input gradient: oneDNN's took 10-48 ms where
    float32's takes 0.1-0.8 ms (MobileNetV2's [16, 96, 33, 33]: 14.6 against 0.8 ms), so it is the
    float32 transposed convolution of the gradient, rounded once. As near float64 as eager's.
    (AOTFUSE_FLOAT32_COMPUTE=0: by default a float16 convolution on a CPU without oneDNN's float16
    path is converted whole before this decomposition sees it, tests/test_float32_compute.py.)"""
    monkeypatch.setenv("AOTFUSE_FLOAT32_COMPUTE", "0")
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = TFPadded().to(dtype).to(memory_format=fmt)
    ref = TFPadded().to(dtype).to(memory_format=fmt)
    ref.load_state_dict(model.state_dict())
    exact = TFPadded().double()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = torch.randn(4, 16, 16, 16).to(dtype).contiguous(memory_format=fmt)
    xs = [x.clone().requires_grad_() for _ in range(2)] + [x.double().requires_grad_()]
    g = torch.randn(4, 16, 8, 8).to(dtype)
    compiled = aotfuse.memory_efficient_fusion(model)
    for m, xi in zip((compiled, ref, exact), xs):
        (m(xi) * g.to(xi.dtype)).sum().backward()
    assert len(_transposed_f32(compiled)) == 3
    assert not any(list(n.args[10])[0] for n in _backward_convs(compiled))  # no 16-bit input gradient left
    got, want, truth = (xi.grad for xi in xs)
    assert got.stride() == want.stride()
    far, eager_far = (got.double() - truth).abs().max().item(), (want.double() - truth).abs().max().item()
    assert far <= eager_far * 1.01 + 1e-6, (far, eager_far)
    for (name, p), q, e in zip(model.named_parameters(), ref.parameters(), exact.parameters()):
        far, eager_far = (p.grad.double() - e.grad).abs().max().item(), (q.grad.double() - e.grad).abs().max().item()
        assert far <= 4 * eager_far + 1e-2 * e.grad.abs().max().item(), (name, far, eager_far)


def test_float32_strided_depthwise_keeps_atens_input_gradient():
    conv = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    compiled = aotfuse.memory_efficient_fusion(conv)
    compiled(x).square().sum().backward()
    assert not _transposed_f32(compiled)
    convs = _backward_convs(compiled)
    assert len(convs) == 1 and list(convs[0].args[10])[:2] == [True, True], [n.args[10] for n in convs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_3x3_depthwise_on_a_map_smaller_than_its_kernel_takes_the_sums(dtype):
    """A 3x3 depthwise convolution on a 2x2 map (EfficientNet's last stage): oneDNN's weight gradient
    allocated a scratch growing with the channels there (16.6 MB at [16, 1152, 2, 2] bf16); the fused
    sums take it, as near float64 as eager's. On a 4x4 map oneDNN's stays (quicker, no large scratch)."""
    torch.manual_seed(0)
    small = nn.Conv2d(32, 32, 3, padding=1, groups=32).to(dtype).to(memory_format=torch.channels_last)
    large = nn.Conv2d(32, 32, 3, padding=1, groups=32).to(dtype).to(memory_format=torch.channels_last)
    for conv, hw, taken in ((small, 2, True), (large, 4, False)):
        x = torch.randn(4, 32, hw, hw).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        g = torch.randn(4, 32, hw, hw).to(dtype)
        exact = nn.Conv2d(32, 32, 3, padding=1, groups=32).double()
        exact.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
        x64 = x.detach().double().requires_grad_()
        (exact(x64) * g.double()).sum().backward()
        compiled = aotfuse.memory_efficient_fusion(conv)
        (compiled(x) * g).sum().backward()
        ours = conv.weight.grad.clone(), conv.bias.grad.clone(), x.grad.clone()
        conv.weight.grad = conv.bias.grad = x.grad = None
        (conv(x) * g).sum().backward()
        eager = conv.weight.grad, conv.bias.grad, x.grad
        for got, want, truth, name in zip(ours, eager, (exact.weight.grad, exact.bias.grad, x64.grad),
                                          ("weight", "bias", "input")):
            far, eager_far = (got.double() - truth).abs().max().item(), (want.double() - truth).abs().max().item()
            assert far <= 4 * eager_far + 4 * torch.finfo(dtype).eps * truth.abs().max().item(), (hw, name, far, eager_far)
        convs = _backward_convs(compiled)
        assert len(convs) == 1 and list(convs[0].args[10])[1] != taken, (hw, [n.args[10] for n in convs])
