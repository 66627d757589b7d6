"""Day 21 mistakes: each must lose its exercise's points, and only its own."""

from autograder.mistakes import Alternative, Mistake

_KV = '''
def kv_bytes(layout, context, dtype_bytes=2):
    total = 0
    for group in layout:
        if "latent" in group:
            per_layer = {mla}
        else:
            per_layer = {gqa}
        window = group.get("window")
        tokens = {tokens}
        total += group["layers"] * per_layer * tokens
    return {result}
'''


def _kv(mla='group["latent"] + group["rope_dim"]', gqa='2 * group["kv_heads"] * group["head_dim"]',
        tokens="context if window is None else min(context, window)",
        result="total * dtype_bytes"):
    return _KV.format(mla=mla, gqa=gqa, tokens=tokens, result=result)


_ABSORBED = '''
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    q_abs = torch.einsum("hn,hnr->hr", q_nope, w_uk)
    scores = {scores}
    weights = torch.softmax(scores, dim={dim})
    return {out}
'''


def _absorbed(scores="(q_abs @ c.T + q_pe @ k_pe.T) * scale", dim="-1",
              out='torch.einsum("hr,hvr->hv", weights @ c, w_uv)'):
    return _ABSORBED.format(scores=scores, dim=dim, out=out)


_HELD = '''
def held_blocks(length, window, block_size):
    oldest = {oldest}
    first = {first}
    last = {last}
    return list(range(first, last))
'''


def _held(oldest="max(length - window + 1, 0)", first="oldest // block_size",
          last="-(-length // block_size)"):
    return _HELD.format(oldest=oldest, first=first, last=last)


_STREAM = '''
def streaming_view(t, window, sinks):
    sink_keys = {sinks}
    window_keys = {window}
    slot = {slot}
    distances = {distances}
    return sink_keys + window_keys, distances
'''


def _stream(sinks="list(range(min(sinks, t + 1)))",
            window="list(range(max(sinks, t - window + 1), t + 1))",
            slot="min(t, sinks + window - 1)",
            distances="[slot - s for s in sink_keys] + [t - j for j in window_keys]"):
    return _STREAM.format(sinks=sinks, window=window, slot=slot, distances=distances)


_LLAMA3 = '''
def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original):
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    smooth = {smooth}
    blended = {blended}
    scaled = torch.where({long_test}, inv_freq / factor, blended)
    return torch.where({short_test}, inv_freq, scaled)
'''


def _llama3(smooth="(original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)",
            blended="(1 - smooth) * inv_freq / factor + smooth * inv_freq",
            long_test="wavelen > low_wavelen", short_test="wavelen < high_wavelen"):
    return _LLAMA3.format(smooth=smooth, blended=blended, long_test=long_test,
                          short_test=short_test)


_FP8 = '''
E4M3_MAX = 448.0


def quantize_fp8(x):
    amax = {amax}
    scale = {scale}
    return {q}, scale


def dequantize_fp8(q, scale):
    return {deq}
'''


def _fp8(amax="x.float().abs().amax(dim=(-2, -1), keepdim=True)",
         scale="torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))",
         q="(x.float() / scale).to(torch.float8_e4m3fn)", deq="q.float() * scale"):
    return _FP8.format(amax=amax, scale=scale, q=q, deq=deq)


MISTAKES = [
    # ------------------------------------------------------------ KV bytes
    # The tests' reference lives in the hidden part only, so an answer that calls it fails at
    # the first visible check (NameError); it stays first of its exercise's mistakes: once a
    # trial has passed the visible checks, the hidden part has defined the reference in the kernel.
    Mistake("kv_bytes", "calls the tests' own kv_truth", '''
def kv_bytes(layout, context, dtype_bytes=2):
    return kv_truth(layout, context, dtype_bytes)
''', says="is not defined"),
    Mistake("kv_bytes", "counts only the keys (no factor 2 for the values)",
            _kv(gqa='group["kv_heads"] * group["head_dim"]'), says="a key AND a value"),
    Mistake("kv_bytes", "counts MLA's latent twice, as if it were a key and a value",
            _kv(mla='2 * (group["latent"] + group["rope_dim"])'), says="ONE latent"),
    Mistake("kv_bytes", "leaves MLA's RoPE key out", _kv(mla='group["latent"]'),
            says="decoupled RoPE key"),
    Mistake("kv_bytes", "treats MLA like heads: 2 x latent", _kv(mla='2 * group["latent"]'),
            says="ONE latent"),
    Mistake("kv_bytes", "ignores the window: every layer holds the whole context",
            _kv(tokens="context"), says="at most `window` tokens"),
    Mistake("kv_bytes", "a windowed layer always holds the whole window, even for a short "
            "sequence", _kv(tokens="context if window is None else window"),
            says="shorter than the window"),
    Mistake("kv_bytes", "a windowed layer holds window - 1 tokens",
            _kv(tokens="context if window is None else min(context, window - 1)"),
            says="exactly `window` tokens"),
    Mistake("kv_bytes", "forgets dtype_bytes", _kv(result="total"), says="dtype_bytes"),
    Mistake("kv_bytes", "returns the bytes per token, not for the context",
            _kv(tokens="1 if window is None else 1"), says="grows with the sequence"),
    Mistake("kv_bytes", "returns GiB as a float", _kv(result="total * dtype_bytes / 2 ** 30"),
            says="Python int"),
    Mistake("kv_bytes", "looks only at the first group", '''
def kv_bytes(layout, context, dtype_bytes=2):
    group = layout[0]
    if "latent" in group:
        per_layer = group["latent"] + group["rope_dim"]
    else:
        per_layer = 2 * group["kv_heads"] * group["head_dim"]
    window = group.get("window")
    tokens = context if window is None else min(context, window)
    return group["layers"] * per_layer * tokens * dtype_bytes
''', says="sum over the groups"),
    # ------------------------------------------------------------ MLA absorbed decode
    Mistake("absorbed_decode", "scores only the latent part, no RoPE key",
            _absorbed(scores="(q_abs @ c.T) * scale"), says="decoupled RoPE part"),
    Mistake("absorbed_decode", "forgets the scale", _absorbed(scores="q_abs @ c.T + q_pe @ k_pe.T"),
            says="multiply the scores by `scale`"),
    Mistake("absorbed_decode", "divides by the scale",
            _absorbed(scores="(q_abs @ c.T + q_pe @ k_pe.T) / scale"), says="scale"),
    Mistake("absorbed_decode", "scales by 1/sqrt(latent width) instead of the given scale",
            _absorbed(scores="(q_abs @ c.T + q_pe @ k_pe.T) / c.shape[-1] ** 0.5"),
            says="another scale"),
    Mistake("absorbed_decode", "softmax over the heads", _absorbed(dim="0"), says="not over the heads"),
    Mistake("absorbed_decode", "returns the weighted latents without W_uv",
            _absorbed(out="weights @ c"), says="goes through w_uv"),
    Mistake("absorbed_decode", "projects the weighted latents with W_uk instead of W_uv",
            _absorbed(out='torch.einsum("hr,hnr->hn", weights @ c, w_uk)'), says=""),
    Mistake("absorbed_decode", "adds the RoPE score after the scale",
            _absorbed(scores="(q_abs @ c.T) * scale + q_pe @ k_pe.T"), says="WHOLE score"),
    Mistake("absorbed_decode", "one head's weights for all heads", '''
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    q_abs = q_nope @ w_uk[0]
    scores = (q_abs @ c.T + q_pe @ k_pe.T) * scale
    weights = torch.softmax(scores, dim=-1)
    return (weights @ c) @ w_uv[0].T
''', says=""),
    Mistake("absorbed_decode", "decompresses every head's keys and values, then attends", '''
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    k = torch.einsum("hnr,sr->hsn", w_uk, c)
    v = torch.einsum("hvr,sr->hsv", w_uv, c)
    scores = (torch.einsum("hn,hsn->hs", q_nope, k) + q_pe @ k_pe.T) * scale
    return torch.einsum("hs,hsv->hv", torch.softmax(scores, dim=-1), v)
''', says="never from keys or values"),
    Mistake("absorbed_decode", "folds W_uk into the query but decompresses the values", '''
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    q_abs = torch.einsum("hn,hnr->hr", q_nope, w_uk)
    weights = torch.softmax((q_abs @ c.T + q_pe @ k_pe.T) * scale, dim=-1)
    v = torch.einsum("hvr,sr->hsv", w_uv, c)
    return torch.einsum("hs,hsv->hv", weights, v)
''', says="never from keys or values"),
    Mistake("absorbed_decode", "decompresses head by head", '''
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    outs = []
    for h in range(q_nope.shape[0]):
        keys, values = c @ w_uk[h].T, c @ w_uv[h].T
        weights = torch.softmax((keys @ q_nope[h] + k_pe @ q_pe[h]) * scale, dim=0)
        outs.append(weights @ values)
    return torch.stack(outs)
''', says="never from keys or values"),
    # ------------------------------------------------------------ held blocks
    # The tests' reference lives in the hidden part only, so an answer that calls it fails at
    # the first visible check (NameError); it stays first of its exercise's mistakes: once a
    # trial has passed the visible checks, the hidden part has defined the reference in the kernel.
    Mistake("held_blocks", "calls the tests' own held_by_the_pool", '''
def held_blocks(length, window, block_size):
    return held_by_the_pool(window, block_size, [length])[length]
''', says="is not defined"),
    Mistake("held_blocks", "the oldest key read is L - W (one too far back)",
            _held(oldest="max(length - window, 0)"), says="L - W + 1"),
    Mistake("held_blocks", "the oldest key read is L - W + 2",
            _held(oldest="max(length - window + 2, 0)"), says="L - W + 1"),
    Mistake("held_blocks", "drops the partly filled last block",
            _held(last="length // block_size"), says="partly filled last block"),
    Mistake("held_blocks", "releases a block that still holds the oldest key read",
            _held(first="-(-oldest // block_size)"), says="even though its first"),
    Mistake("held_blocks", "no clamp: a negative oldest position gives block -1",
            _held(oldest="length - window + 1"), says="never a negative position"),
    Mistake("held_blocks", "never releases anything", _held(first="0"),
            says="are released"),
    Mistake("held_blocks", "returns a range, not a list", '''
def held_blocks(length, window, block_size):
    oldest = max(length - window + 1, 0)
    return range(oldest // block_size, -(-length // block_size))
''', says="a list of ints"),
    # ------------------------------------------------------------ streaming view
    # The tests' reference lives in the hidden part only, so an answer that calls it fails at
    # the first visible check (NameError); it stays first of its exercise's mistakes: once a
    # trial has passed the visible checks, the hidden part has defined the reference in the kernel.
    Mistake("streaming_view", "calls the tests' own simulate_streaming", '''
def streaming_view(t, window, sinks):
    return simulate_streaming(t, window, sinks)
''', says="is not defined"),
    Mistake("streaming_view", "the window starts at max(0, t - W + 1): sinks counted twice",
            _stream(window="list(range(max(0, t - window + 1), t + 1))"), says="a second time"),
    Mistake("streaming_view", "all sinks are visible, even before they exist",
            _stream(sinks="list(range(sinks))"), says="only the sinks that exist"),
    Mistake("streaming_view", "the window holds W + 1 tokens",
            _stream(window="list(range(max(sinks, t - window), t + 1))"),
            says="not one more or one fewer"),
    Mistake("streaming_view", "the window holds W - 1 tokens",
            _stream(window="list(range(max(sinks, t - window + 2), t + 1))"),
            says="not one more or one fewer"),
    Mistake("streaming_view", "gives the sinks their text distances",
            _stream(distances="[t - s for s in sink_keys] + [t - j for j in window_keys]"),
            says="measured inside the cache"),
    Mistake("streaming_view", "returns the keys' cache slots instead of distances",
            _stream(distances="list(range(len(sink_keys) + len(window_keys)))"),
            says="query's slot minus the key's slot"),
    Mistake("streaming_view", "puts the query in slot sinks + window (one past the cache)",
            _stream(slot="min(t, sinks + window)"), says=""),
    Mistake("streaming_view", "returns the window before the sinks", '''
def streaming_view(t, window, sinks):
    sink_keys = list(range(min(sinks, t + 1)))
    window_keys = list(range(max(sinks, t - window + 1), t + 1))
    slot = min(t, sinks + window - 1)
    distances = [t - j for j in window_keys] + [slot - s for s in sink_keys]
    return window_keys + sink_keys, distances
''', says=""),
    # ------------------------------------------------------------ llama3 RoPE scaling
    Mistake("llama3_inv_freq", "swaps the blend's weights",
            _llama3(blended="smooth * inv_freq / factor + (1 - smooth) * inv_freq"),
            says="weights swapped"),
    Mistake("llama3_inv_freq", "swaps the two ends: divides the short wavelengths",
            _llama3(long_test="wavelen < high_wavelen", short_test="wavelen > low_wavelen"),
            says="swaps the two ends"),
    Mistake("llama3_inv_freq", "divides every frequency by the factor (linear scaling)", '''
def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original):
    return inv_freq / factor
''', says="only the long wavelengths"),
    Mistake("llama3_inv_freq", "leaves the middle band unscaled", _llama3(blended="inv_freq"),
            says="is blended"),
    Mistake("llama3_inv_freq", "divides the middle band outright",
            _llama3(blended="inv_freq / factor"), says="is blended"),
    Mistake("llama3_inv_freq", "uses wavelength / L in smooth",
            _llama3(smooth="(wavelen / original - low_freq_factor) / "
                           "(high_freq_factor - low_freq_factor)"), says=""),
    Mistake("llama3_inv_freq", "compares frequencies with the thresholds instead of wavelengths",
            _llama3(long_test="inv_freq > low_wavelen", short_test="inv_freq < high_wavelen"),
            says=""),
    Mistake("llama3_inv_freq", "computes in float32 whatever the input (float64 loses digits)", '''
def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original):
    dtype = inv_freq.dtype
    inv_freq = inv_freq.float()
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelen < original / high_freq_factor, inv_freq, scaled).to(dtype)
''', says=""),
    # right values, but the caller's plain frequencies are gone
    Mistake("llama3_inv_freq", "scales the caller's inv_freq in place", '''
def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original):
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    long = wavelen > original / low_freq_factor
    middle = (wavelen >= original / high_freq_factor) & ~long
    inv_freq[long] /= factor
    inv_freq[middle] = blended[middle]
    return inv_freq
''', says="changed its input inv_freq"),
    # ------------------------------------------------------------ fp8 KV
    Mistake("fp8", "one scale per token, as day 15's int8",
            _fp8(amax="x.float().abs().amax(dim=-1, keepdim=True)"), says="one scale per HEAD"),
    Mistake("fp8", "one scale for the whole tensor",
            _fp8(amax="x.float().abs().amax()"), says="not a single scale"),
    Mistake("fp8", "one scale per head shared by the whole batch (amax over the batch too)",
            _fp8(amax="x.float().abs().amax(dim=(0, 2, 3), keepdim=True)"),
            says="OF EACH SEQUENCE"),
    Mistake("fp8", "returns the per-head scale as (B, H), without keepdim",
            _fp8(amax="x.float().abs().amax(dim=(-2, -1))",
                 q="(x.float() / scale[..., None, None]).to(torch.float8_e4m3fn)"),
            says="keep the scale's shape (B, H, 1, 1)"),
    Mistake("fp8", "returns the per-head scale as (B, H, 1), one size-1 dim dropped",
            _fp8(amax="x.float().abs().amax(dim=-1).amax(dim=-1, keepdim=True)",
                 q="(x.float() / scale[..., None]).to(torch.float8_e4m3fn)"),
            says="keep the scale's shape (B, H, 1, 1)"),
    Mistake("fp8", "divides the amax by 127, int8's range",
            _fp8(scale="torch.where(amax > 0, amax / 127, torch.ones_like(amax))"),
            says="largest value is 448"),
    Mistake("fp8", "takes the amax without abs",
            _fp8(amax="x.float().amax(dim=(-2, -1), keepdim=True)",
                 scale="torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))"),
            says="most NEGATIVE value"),
    Mistake("fp8", "no guard for a head of zeros (scale 0, NaN)",
            _fp8(scale="amax / E4M3_MAX"), says="head of all zeros"),
    Mistake("fp8", "guards a head of zeros with clamp_min(1e-12): a tiny scale, not 1",
            _fp8(amax="x.float().abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-12)",
                 scale="amax / E4M3_MAX"), says="clamp_min"),
    # right q and scale, but for float32 x, x.float() is x: the caller's cache is divided
    Mistake("fp8", "divides x by the scale in place", '''
E4M3_MAX = 448.0


def quantize_fp8(x):
    amax = x.float().abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x = x.float()
    x /= scale
    return x.to(torch.float8_e4m3fn), scale


def dequantize_fp8(q, scale):
    return q.float() * scale
''', says="changed its input x"),
    Mistake("fp8", "casts to e5m2", _fp8(q="(x.float() / scale).to(torch.float8_e5m2)"),
            says="float8_e4m3fn"),
    Mistake("fp8", "casts x without dividing by the scale",
            _fp8(q="x.float().to(torch.float8_e4m3fn)"), says="e4m3(x / scale)"),
    Mistake("fp8", "dequantizes by dividing by the scale", _fp8(deq="q.float() / scale"),
            says="multiplies by the scale"),
    Mistake("fp8", "dequantizes to bfloat16",
            _fp8(deq="(q.float() * scale).to(torch.bfloat16)"), says="returns float32"),
    Mistake("fp8", "returns the scale in float64",
            _fp8(amax="x.double().abs().amax(dim=(-2, -1), keepdim=True)"), says="float32"),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "thinks the latent cannot hold positions", 'answer_q1 = "B"\n'),
    Mistake("q2", "forgets the partly filled last block: floor(L / B) - first",
            "answer_q2 = 10014 // 16 - 5919 // 16\n"),
    Mistake("q2", "counts the window's W / B blocks, as if it started at a block boundary",
            "answer_q2 = 4096 // 16\n"),
    Mistake("q2", "takes ceil(L / B) as the last block's index", "answer_q2 = 258\n"),
    Mistake("q2", "writes the count as a float", "answer_q2 = 257.0\n"),
    Mistake("q3", "thinks the first tokens carry the meaning", 'answer_q3 = "A"\n'),
]

_BOUNDARY = ("at the wavelength L / low_freq_factor smooth is 0 and the blend equals inv_freq / "
             "factor; at L / high_freq_factor smooth is 1 and it equals inv_freq: both sides of "
             "the comparison give the same frequency (and no RoPE wavelength is exactly L / n)")
EQUIVALENT_MUTANTS = {
    "llama3_inv_freq: scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, blended) "
    "=> scaled = torch.where(wavelen >= low_wavelen, inv_freq / factor, blended)": _BOUNDARY,
    "llama3_inv_freq: return torch.where(wavelen < high_wavelen, inv_freq, scaled) => "
    "return torch.where(wavelen <= high_wavelen, inv_freq, scaled)": _BOUNDARY,
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('kv_bytes', 'sum generator', """
def kv_bytes(layout, context, dtype_bytes=2):
    return sum(g["layers"] * (g.get("latent", 0) + g.get("rope_dim", 0) + 2 * g.get("kv_heads", 0) * g.get("head_dim", 0))
               * min(context, g.get("window", context)) * dtype_bytes for g in layout)
"""),
    Alternative('absorbed_decode', 'float64 inside, cast back', """
def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    d = lambda t: t.double()
    q_abs = torch.einsum("hn,hnr->hr", d(q_nope), d(w_uk))
    s = (q_abs @ d(c).T + d(q_pe) @ d(k_pe).T) * scale
    p = torch.softmax(s, -1)
    return torch.einsum("hr,hvr->hv", p @ d(c), d(w_uv)).to(q_nope.dtype)
"""),
    Alternative('held_blocks', 'integer arithmetic', """
def held_blocks(length, window, block_size):
    if length == 0:
        return []
    first = max(0, (length - window + 1) // block_size) if length >= window else 0
    last = (length - 1) // block_size
    return list(range(first, last + 1))
"""),
    Alternative('streaming_view', 'simulate the cache', """
def streaming_view(t, window, sinks):
    cache = []
    for p in range(t + 1):
        if len(cache) == sinks + window:
            cache.pop(sinks)
        cache.append(p)
    n = len(cache)
    return cache, [n - 1 - i for i in range(n)]
"""),
    Alternative('fp8', 'clamp then cast, masked_fill', """
def quantize_fp8(x):
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=(2, 3), keepdim=True) / 448.0
    scale = scale.masked_fill(scale == 0, 1.0)
    q = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale

def dequantize_fp8(q, scale):
    return torch.mul(q.float(), scale)
"""),
    Alternative('q2', 'python int', """
answer_q2 = -(-10014 // 16) - (10014 - 4096 + 1) // 16
"""),
    Alternative('q2', 'numpy int', """
import numpy as np
answer_q2 = np.int64(-(-10014 // 16) - (10014 - 4096 + 1) // 16)
"""),
    # an integer self-check answer computed with numpy (np.int64 is a numbers.Integral)
    Alternative('q2', 'a NumPy int64', '''
# Set answer_q2 to an integer.
import numpy as np
answer_q2 = np.int64(10014) // 16 - 5919 // 16 + 1
'''),
]
