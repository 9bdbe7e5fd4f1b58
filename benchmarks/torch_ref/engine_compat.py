"""NumPy ports of the engine's random numbers, synthetic data and parameter initialisation.

Everything here is bit-exact against the C++ engine (float32, same roundings):
  philox4x32 / random_u32 / uniform / mix_key     kernels/philox.hpp
  SyntheticDataset (labels, prototypes, noise)     dp/data/synthetic.cpp
  init_values, kaiming_uniform, torch_default      nn/module.hpp
  the parameter lists of mlp / lenet / resnet      nn/zoo.hpp (names and order of named_parameters)
The one exception is InitSpec.normal (Box-Muller through libm log/cos), which no bench model
uses: it matches to about one ulp, not bit for bit.

No torch here: models.py builds torch modules and loads `init_params` into them.
"""

import numpy as np

U32 = np.uint64(0xFFFFFFFF)


def _u64(x):
    return np.asarray(x, dtype=np.uint64)


# ---- kernels/philox.hpp ---------------------------------------------------------------------


def mix_key(seed, a, b=0):
    """Mixes (seed, a, b) into one 64-bit key; any argument may be an array (broadcast)."""
    with np.errstate(over="ignore"):
        h = _u64(seed) ^ np.uint64(0x9E3779B97F4A7C15)
        h = (h ^ (_u64(a) + np.uint64(0x632BE59BD9B4E019) + (h << np.uint64(6))
                  + (h >> np.uint64(2)))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (_u64(b) + np.uint64(0x94D049BB133111EB) + (h << np.uint64(6))
                  + (h >> np.uint64(2)))) * np.uint64(0x94D049BB133111EB)
        return h ^ (h >> np.uint64(31))


def philox4x32(key, ctr):
    """Philox4x32-10: four uint32 arrays (x, y, z, w) for counters `ctr` under keys `key`.

    key and ctr are uint64 (arrays or scalars, broadcast against each other). 32-bit words are
    held in uint64 arrays so that the 32x32 -> 64 products (mulhilo) cannot overflow.
    """
    key, ctr = np.broadcast_arrays(_u64(key), _u64(ctr))
    k0, k1 = key & U32, key >> np.uint64(32)
    x, y = ctr & U32, ctr >> np.uint64(32)
    z = np.zeros_like(x)
    w = np.zeros_like(x)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p1 = m0 * x, m1 * z  # < 2^64: no wraparound
        hi0, lo0 = p0 >> np.uint64(32), p0 & U32
        hi1, lo1 = p1 >> np.uint64(32), p1 & U32
        x, y, z, w = hi1 ^ y ^ k0, lo1, hi0 ^ w ^ k1, lo0
        k0 = (k0 + np.uint64(0x9E3779B9)) & U32
        k1 = (k1 + np.uint64(0xBB67AE85)) & U32
    return tuple(v.astype(np.uint32) for v in (x, y, z, w))


def random_u32(key, i):
    """Word i % 4 of block i / 4: element i of the stream under `key`."""
    i = _u64(i)
    words = philox4x32(key, i >> np.uint64(2))
    sel = (i & np.uint64(3)).astype(np.int64)
    return np.choose(sel, words).astype(np.uint32)


def random_u32_range(key, first, end):
    """random_u32(key, arange(first, end)) with each Philox block computed once (its four
    words are four elements): a quarter of the work, for the long ranges of an init."""
    if end <= first:
        return np.zeros(0, dtype=np.uint32)
    b0, b1 = first >> 2, (end - 1) >> 2
    blocks = np.arange(b0, b1 + 1, dtype=np.uint64)
    words = np.stack(philox4x32(key, blocks), axis=1).reshape(-1)
    at = first - 4 * b0
    return words[at:at + (end - first)]


def _to_uniform(words):
    return (words >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def uniform(key, i):
    """Uniform in [0, 1) with 24 bits, float32."""
    return _to_uniform(random_u32(key, i))


def uniform_range(key, first, end):
    """uniform(key, arange(first, end)), through random_u32_range."""
    return _to_uniform(random_u32_range(key, first, end))


# ---- dp/data/synthetic.cpp ------------------------------------------------------------------

LABEL_STREAM, PROTOTYPE_STREAM, NOISE_STREAM = 1, 2, 3
_SQRT3 = np.float32(1.7320508075688772)
_UNIT_UNIFORM_SCALE = np.float32(2.0) * _SQRT3 / np.float32(16777216.0)  # exact: powers of 2
_UNIT_NOISE_INV_STD = np.float32(0.006765875086793228)  # 1 / sqrt(4 (256^2 - 1) / 12)


def unit_uniform(word):
    """Uniform with unit variance on (-sqrt 3, sqrt 3) from the top 24 bits of `word`."""
    centred = (np.asarray(word, dtype=np.uint32) >> np.uint32(8)).astype(np.int32) - (1 << 23)
    return (centred.astype(np.float32) + np.float32(0.5)) * _UNIT_UNIFORM_SCALE


def unit_noise(word):
    """Irwin-Hall: the sum of the four bytes of `word` (1021 levels), centred, unit variance."""
    w = np.asarray(word, dtype=np.uint32)
    s = sum(((w >> np.uint32(shift)) & np.uint32(0xFF)).astype(np.int32)
            for shift in (0, 8, 16, 24))
    return (s - 510).astype(np.float32) * _UNIT_NOISE_INV_STD


class SyntheticDataset:
    """dp::data::SyntheticDataset: sample(i) = signal * prototype[label(i)] + noise * n(seed, i).

    label(i) = philox(mix_key(seed, 1), i).x mod classes; prototype[c][j] = unit_uniform of word j
    under mix_key(seed, 2, c); the noise of elements 4k..4k+3 is unit_noise of the four words of
    Philox block k under mix_key(seed, 3, i).

    Bit-exact for the default signal = noise = 1 (other scales can differ where the C++
    compiler contracts a multiply-add into an FMA).
    """

    def __init__(self, size, sample_shape=(1, 28, 28), num_classes=10, seed=1, signal=1.0,
                 noise=1.0):
        self.size = int(size)
        self.sample_shape = tuple(int(d) for d in sample_shape)
        self.numel = int(np.prod(self.sample_shape))
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.signal, self.noise = np.float32(signal), np.float32(noise)
        keys = mix_key(self.seed, PROTOTYPE_STREAM, np.arange(self.num_classes, dtype=np.uint64))
        j = np.arange(self.numel, dtype=np.uint64)
        # (num_classes, numel): signal * prototype
        self.prototypes = self.signal * unit_uniform(random_u32(keys[:, None], j[None, :]))

    def labels(self, indices):
        """int32 labels of `indices` (an array of sample indices)."""
        x = philox4x32(mix_key(self.seed, LABEL_STREAM), _u64(indices))[0]
        return (x % np.uint32(self.num_classes)).astype(np.int32)

    def samples(self, indices):
        """(images float32 (n, *sample_shape), labels int32 (n,)) of `indices`."""
        indices = _u64(np.atleast_1d(indices))
        labels = self.labels(indices)
        keys = mix_key(self.seed, NOISE_STREAM, indices)[:, None]
        blocks = np.arange((self.numel + 3) // 4, dtype=np.uint64)[None, :]
        words = philox4x32(keys, blocks)  # one block: the noise of four elements
        noise = np.empty((len(indices), 4 * blocks.shape[1]), dtype=np.float32)
        for k in range(4):
            noise[:, k::4] = self.noise * unit_noise(words[k])
        images = self.prototypes[labels] + noise[:, :self.numel]
        return images.reshape((len(indices),) + self.sample_shape), labels

    def batch(self, first, count):
        """Samples [first, first + count): dp::data::make_batch(dataset, first, count)."""
        return self.samples(np.arange(first, first + count, dtype=np.uint64))


def chunk_sizes(batch, n):
    """dp::DataParallel::chunk_sizes: B / N each, the first B % N one more."""
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


# ---- nn/module.hpp: init specs and values ---------------------------------------------------

f32 = np.float32


def constant(v):
    return ("constant", f32(v))


def uniform_spec(bound):
    return ("uniform", f32(bound))


def kaiming_uniform(fan_in, a=f32(0.0)):
    a = f32(a)
    gain = np.sqrt(f32(2.0) / (f32(1.0) + a * a))
    return uniform_spec(gain * np.sqrt(f32(3.0) / f32(fan_in)))


def torch_default(fan_in):
    return uniform_spec(f32(1.0) / np.sqrt(f32(max(fan_in, 1))))


SQRT5 = np.sqrt(f32(5.0))  # std::sqrt(5.f)


def init_values(spec, count, key, chunk=1 << 22):
    """nn::init_values: `count` float32 values of spec (kind, scale) under `key` (made `chunk`
    values at a time, so a GPT-2 embedding does not take gigabytes of temporaries)."""
    kind, scale = spec
    if count > chunk and kind != "constant":
        return np.concatenate([_init_range(spec, a, min(a + chunk, count), key)
                               for a in range(0, count, chunk)])
    return _init_range(spec, 0, count, key)


def _init_range(spec, first, end, key):
    """Values first..end-1 of init_values(spec, ., key)."""
    kind, scale = spec
    count = end - first
    if kind == "constant":
        return np.full(count, scale, dtype=f32)
    if kind == "uniform":
        return (f32(2.0) * uniform_range(key, first, end) - f32(1.0)) * scale
    if kind == "normal":  # Box-Muller; libm rounding: not guaranteed bit-exact
        u = uniform_range(key, 2 * first, 2 * end)  # element 2 i, then 2 i + 1
        u1 = u[0::2] + f32(1.0 / 16777216.0)
        u2 = u[1::2]
        return scale * np.sqrt(f32(-2.0) * np.log(u1)) * np.cos(f32(6.2831853) * u2)
    raise ValueError(f"unknown init kind {kind!r}")


# ---- nn/zoo.hpp: parameter lists (name, shape, spec) in named_parameters() order -------------


def _linear(prefix, n_in, n_out, bias=True):
    out = [(prefix + "weight", (n_out, n_in), kaiming_uniform(n_in, SQRT5))]  # (out, in) as torch
    if bias:
        out.append((prefix + "bias", (n_out,), torch_default(n_in)))
    return out


def _conv(prefix, c_in, c_out, k, bias=True):
    fan_in = c_in * k * k
    out = [(prefix + "weight", (c_out, c_in, k, k), kaiming_uniform(fan_in, SQRT5))]  # (K,C,R,S)
    if bias:
        out.append((prefix + "bias", (c_out,), torch_default(fan_in)))
    return out


def _bn(prefix, c):
    return [(prefix + "weight", (c,), constant(1.0)), (prefix + "bias", (c,), constant(0.0))]


def mlp_params(sizes=(784, 256, 256, 10)):
    """Sequential: 0 Flatten, then Linear at 1, 3, 5, ... with ReLU between."""
    out = []
    for i in range(len(sizes) - 1):
        out += _linear(f"{2 * i + 1}.", sizes[i], sizes[i + 1])
    return out


def lenet_params(in_channels=1, classes=10, image_size=28):
    s = ((image_size // 2) - 4) // 2
    return (_conv("0.", in_channels, 6, 5) + _conv("3.", 6, 16, 5) + _linear("7.", 16 * s * s, 120)
            + _linear("9.", 120, 84) + _linear("11.", 84, classes))


def basic_block_params(prefix, c_in, c_out, stride):
    """Sequential(0: Residual(block, shortcut), 1: ReLU)."""
    body = prefix + "0.block."
    out = (_conv(body + "0.", c_in, c_out, 3, bias=False) + _bn(body + "1.", c_out)
           + _conv(body + "3.", c_out, c_out, 3, bias=False) + _bn(body + "4.", c_out))
    if stride != 1 or c_in != c_out:
        sc = prefix + "0.shortcut."
        out += _conv(sc + "0.", c_in, c_out, 1, bias=False) + _bn(sc + "1.", c_out)
    return out


def resnet_params(depth=8, in_channels=1, classes=10, width=16):
    blocks = (depth - 2) // 6
    out = _conv("0.", in_channels, width, 3, bias=False) + _bn("1.", width)
    channels, index = width, 3
    for stage in range(3):
        c_out = width << stage
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            out += basic_block_params(f"{index}.", channels, c_out, stride)
            channels, index = c_out, index + 1
    index += 1  # GlobalAvgPool
    return out + _linear(f"{index}.", channels, classes)


# ---- nn/gpt.hpp: GptConfig presets and the parameter list of nn::Gpt -------------------------

GPT_PRESETS = {  # name: (vocab, context, layers, heads, dim)
    "tiny": (256, 128, 4, 4, 128),
    "124m": (50304, 1024, 12, 12, 768),
    "350m": (50304, 1024, 24, 16, 1024),
}


def normal(std):
    return ("normal", f32(std))


def gpt_params(config):
    """nn::Gpt's parameters in flat order: wpe, wte.weight, h.<l>.{ln_1, attn.c_attn,
    attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias}, ln_f.{weight, bias}. Init as
    GPT-2: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm 1, 0."""
    vocab, context, layers, _, d = GPT_PRESETS[config]
    w = normal(0.02)
    w_resid = normal(f32(0.02) / np.sqrt(f32(2.0) * f32(layers)))
    zero, one = constant(0.0), constant(1.0)
    out = [("wpe", (context, d), w), ("wte.weight", (vocab, d), w)]

    def ln(prefix):
        return [(prefix + "weight", (d,), one), (prefix + "bias", (d,), zero)]

    for l in range(layers):
        p = f"h.{l}."
        out += ln(p + "ln_1.")
        out += [(p + "attn.c_attn.weight", (3 * d, d), w), (p + "attn.c_attn.bias", (3 * d,), zero),
                (p + "attn.c_proj.weight", (d, d), w_resid), (p + "attn.c_proj.bias", (d,), zero)]
        out += ln(p + "ln_2.")
        out += [(p + "mlp.c_fc.weight", (4 * d, d), w), (p + "mlp.c_fc.bias", (4 * d,), zero),
                (p + "mlp.c_proj.weight", (d, 4 * d), w_resid), (p + "mlp.c_proj.bias", (d,), zero)]
    return out + ln("ln_f.")


def gpt_flops_per_token(config, seq):
    """nn::GptConfig::flops_per_token: 6 P + 12 L T D."""
    vocab, context, layers, _, d = GPT_PRESETS[config]
    params = sum(int(np.prod(shape)) for _, shape, _ in gpt_params(config))
    return 6.0 * params + 12.0 * layers * seq * d


def synthetic_token_batch(batch, seq, vocab, seed, step):
    """dp::data::synthetic_token_batch: (ids, targets) int32 (batch, seq) from (seed, step):
    a stream of batch (seq + 1) tokens min(floor(uniform * vocab), vocab - 1), row b its
    window [b (seq + 1), (b + 1)(seq + 1)), targets the next token."""
    u = uniform(mix_key(seed, step), np.arange(batch * (seq + 1), dtype=np.uint64))
    stream = np.minimum(np.floor(u.astype(np.float64) * vocab), vocab - 1).astype(np.int32)
    stream = stream.reshape(batch, seq + 1)
    return stream[:, :seq].copy(), stream[:, 1:].copy()


class SyntheticTokens:
    """dp_bench --model gpt's data: batch(first, count) is step first / count's token batch."""

    def __init__(self, vocab, seq, seed):
        self.vocab, self.seq, self.seed = int(vocab), int(seq), int(seed)

    def batch(self, first, count):
        return synthetic_token_batch(count, self.seq, self.vocab, self.seed, first // count)


def model_params(name):
    """The bench models of benchmarks/bench_common.cpp make_model(), and gpt-<preset>."""
    if name.startswith("gpt-"):
        return gpt_params(name[4:])
    if name == "mlp":
        return mlp_params((784, 256, 256, 10))
    if name == "cnn":
        return lenet_params(1, 10)
    if name == "resnet":
        return resnet_params(8, 1, 10)
    raise ValueError(f"unknown model {name!r} (mlp|cnn|resnet)")


def init_params(name, seed):
    """[(name, float32 array of its shape)]: what materialize(device, seed) gives parameter i,
    init_values(spec, numel, mix_key(seed, i)), in the engine's flat order."""
    out = []
    for i, (pname, shape, spec) in enumerate(model_params(name)):
        values = init_values(spec, int(np.prod(shape)), mix_key(seed, i))
        out.append((pname, values.reshape(shape)))
    return out


def flat_params(name, seed):
    """The engine's flat parameter buffer after materialize(device, seed)."""
    return np.concatenate([v.ravel() for _, v in init_params(name, seed)])
