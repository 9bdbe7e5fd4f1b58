"""Torch versions of the bench models of nn/zoo.hpp, layer by layer, with the engine's names.

Module names follow the engine's (Sequential children "0", "1", ...; Residual children "block"
and "shortcut"), so named_parameters() gives the same names in the same order as the engine's
flat buffer, and build(name, seed) starts from the engine's initial weights for that seed.
Layouts already agree: Linear weight (out, in), Conv2d weight (K, C, R, S), BatchNorm
weight/bias (C) with running_mean 0 / running_var 1, momentum 0.1, eps 1e-5.
"""

import torch
import torch.nn.functional as F
from torch import nn

import engine_compat as ec


class Residual(nn.Module):
    """y = block(x) + shortcut(x); the identity when there is no shortcut."""

    def __init__(self, block, shortcut=None):
        super().__init__()
        self.block = block
        self.shortcut = shortcut

    def forward(self, x):
        return self.block(x) + (self.shortcut(x) if self.shortcut is not None else x)


class GlobalAvgPool(nn.Module):
    """(N, C, H, W) -> (N, C)."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


def mlp(sizes=(784, 256, 256, 10)):
    layers = [nn.Flatten()]
    for i in range(len(sizes) - 1):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
    return nn.Sequential(*layers)


def lenet(in_channels=1, classes=10, image_size=28):
    s = ((image_size // 2) - 4) // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, stride=1, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * s * s, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, classes))


def basic_block(c_in, c_out, stride):
    body = nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out),
        nn.ReLU(), nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(c_out))
    shortcut = None
    if stride != 1 or c_in != c_out:
        shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, padding=0, bias=False),
                                 nn.BatchNorm2d(c_out))
    return nn.Sequential(Residual(body, shortcut), nn.ReLU())


def resnet(depth=8, in_channels=1, classes=10, width=16):
    blocks = (depth - 2) // 6
    layers = [nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
              nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage in range(3):
        c_out = width << stage
        for b in range(blocks):
            layers.append(basic_block(channels, c_out, 2 if stage > 0 and b == 0 else 1))
            channels = c_out
    layers += [GlobalAvgPool(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


class GptAttention(nn.Module):
    """nn::CausalSelfAttention: qkv = c_attn(x) as [q | k | v], heads inside each; causal SDPA
    with scale 1 / sqrt(D / H); c_proj."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GptMlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GptBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = GptAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = GptMlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """nn::Gpt (nn/gpt.hpp): ids (B, T) -> logits (B, T, vocab); LM head tied to wte; no dropout
    (dp_bench's default, nanoGPT's). Parameter names and order are the engine's."""

    def __init__(self, config):
        super().__init__()
        vocab, context, layers, heads, d = ec.GPT_PRESETS[config]
        self.wpe = nn.Parameter(torch.empty(context, d))
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(GptBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def make_model(name):
    """benchmarks/bench_common.cpp make_model(): mlp | cnn | resnet, or gpt-<preset>."""
    if name.startswith("gpt-"):
        return Gpt(name[4:])
    if name == "mlp":
        return mlp((784, 256, 256, 10))
    if name == "cnn":
        return lenet(1, 10)
    if name == "resnet":
        return resnet(8, 1, 10)
    raise ValueError(f"unknown model {name!r} (mlp|cnn|resnet)")


def load_engine_init(model, name, seed):
    """Overwrites the parameters of `model` with the engine's initial values for `seed`."""
    ours = ec.init_params(name, seed)
    theirs = list(model.named_parameters())
    got = [(n, tuple(p.shape)) for n, p in theirs]
    want = [(n, tuple(v.shape)) for n, v in ours]
    if got != want:
        raise RuntimeError(f"{name}: torch parameters {got} do not match the engine's {want}")
    with torch.no_grad():
        for (_, p), (_, v) in zip(theirs, ours):
            p.copy_(torch.from_numpy(v))
    return model


def build(name, seed):
    """The bench model `name` on the CPU, holding the engine's initial weights for `seed`."""
    return load_engine_init(make_model(name), name, seed)
