"""Day 15 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------ int8 per channel
    Mistake("quantize_int8", "scales from the wrong axis (one per column)", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=0)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[None, :]).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "rounds with floor", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.floor(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "truncates with .to(torch.int8) instead of rounding", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "divides by 128 and clamps to [-128, 127] (an asymmetric range)", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 128, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "uses 255 levels for the scale of a symmetric range", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 255, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "one scale for the whole tensor", """
def quantize_int8(w):
    w = w.float()
    amax = w.abs().max().expand(w.shape[0])
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_int8", "no guard for an all-zero row (0 / 0 = NaN)", """
def quantize_int8(w):
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
""", says="the exercise gives such a row scale 1.0"),
    # ------------------------------------------------------------ int4 groups
    Mistake("quantize_int4", "16 steps instead of 15 (levels off by one)", """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 16
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "zero point off by one (rounds -lo / s up)", """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.ceil(-lo / scale)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "zero point with the wrong sign convention (z = round(lo / s) + 15)",
            """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(hi / scale)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "groups of strided columns (view(N, G, K // G) then the wrong axis)",
            """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, group_size, K // group_size).transpose(1, 2)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.transpose(1, 2).reshape(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "range not widened to contain 0 (lo = group min)", """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "rounds with floor", """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = (torch.floor(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Mistake("quantize_int4", "no guard for an all-zero group", """
def quantize_int4(w, group_size):
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    zero = torch.nan_to_num(torch.round(-lo / scale))
    q = torch.nan_to_num(torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(torch.uint8)
""", says="the exercise gives them scale 1.0"),
    # ------------------------------------------------------------ nibbles
    Mistake("pack_int4", "int4 nibbles swapped (even column in the high nibble)", """
def pack_int4(q):
    return (q[..., 0::2] << 4) | q[..., 1::2]


def unpack_int4(packed):
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).flatten(-2)
"""),
    Mistake("pack_int4", "unpack concatenates all low nibbles, then all high ones", """
def pack_int4(q):
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed):
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
"""),
    Mistake("pack_int4", "unpack masks the high nibble without shifting it down", """
def pack_int4(q):
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed):
    return torch.stack([packed & 0x0F, packed & 0xF0], dim=-1).flatten(-2)
"""),
    Mistake("pack_int4", "packs and unpacks along axis 1 (a 2-D input only)", """
def pack_int4(q):
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed):
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
""", says="work along the LAST axis"),
    Mistake("pack_int4", "packs pairs of rows of the first half and second half", """
def pack_int4(q):
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def unpack_int4(packed):
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
"""),
    # ------------------------------------------------------------ the dequantizing linear
    Mistake("int4_linear", "subtracts the zero point in uint8 (wraps around below zero)", """
def int4_linear(x, packed, scale, zero, group_size):
    q = unpack_int4(packed)
    z = zero.repeat_interleave(group_size, dim=1)
    s = scale.float().repeat_interleave(group_size, dim=1)
    w = (q - z).float() * s
    return x.float() @ w.T
""", says="convert q and zero to float BEFORE subtracting"),
    Mistake("int4_linear", "forgets the zero point", """
def int4_linear(x, packed, scale, zero, group_size):
    q = unpack_int4(packed).float()
    s = scale.float().repeat_interleave(group_size, dim=1)
    return x.float() @ (q * s).T
"""),
    Mistake("int4_linear", "tiles the group scales with repeat instead of repeat_interleave", """
def int4_linear(x, packed, scale, zero, group_size):
    q = unpack_int4(packed).float()
    z = zero.float().repeat(1, group_size)
    s = scale.float().repeat(1, group_size)
    return x.float() @ ((q - z) * s).T
"""),
    Mistake("int4_linear", "multiplies by the scale before subtracting the zero point", """
def int4_linear(x, packed, scale, zero, group_size):
    q = unpack_int4(packed).float()
    z = zero.float().repeat_interleave(group_size, dim=1)
    s = scale.float().repeat_interleave(group_size, dim=1)
    return x.float() @ (q * s - z).T
"""),
    # ------------------------------------------------------------ int8 KV cache
    Mistake("quantize_kv", "scales from the wrong axis (one per channel, across tokens)", """
def quantize_kv(x):
    amax = x.float().abs().amax(dim=-2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.transpose(-1, -2)[..., :1].expand(*x.shape[:-1], 1)
"""),
    Mistake("quantize_kv", "one scale per head for all tokens", """
def quantize_kv(x):
    amax = x.float().abs().amax(dim=(-2, -1), keepdim=True).expand(*x.shape[:-1], 1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_kv", "rounds with floor", """
def quantize_kv(x):
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.floor(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale
"""),
    Mistake("quantize_kv", "no guard for a zero vector", """
def quantize_kv(x):
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127
    q = torch.nan_to_num(torch.round(x.float() / scale)).clamp(-127, 127).to(torch.int8)
    return q, scale
""", says="the exercise gives it scale 1.0"),
    # ------------------------------------------------------------ GGUF Q8_0 blocks
    Mistake("dequantize_q8_0", "reads the codes as unsigned bytes", """
def dequantize_q8_0(blocks):
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].astype(np.float32)
    return d * q
"""),
    Mistake("dequantize_q8_0", "expects the scale after the codes", """
def dequantize_q8_0(blocks):
    q = blocks[:, :32].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 32:].copy().view(np.float16).astype(np.float32)
    return d * q
"""),
    Mistake("dequantize_q8_0", "reads the float16 scale big-endian", """
def dequantize_q8_0(blocks):
    d = blocks[:, 1::-1].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return d * q
"""),
    Mistake("dequantize_q8_0", "reads a float32 scale from the first four bytes", """
def dequantize_q8_0(blocks):
    d = blocks[:, :4].copy().view(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return d * q
"""),
    Mistake("dequantize_q8_0", "multiplies in float16", """
def dequantize_q8_0(blocks):
    d = blocks[:, :2].copy().view(np.float16)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float16)
    return (d * q).astype(np.float32)
""", says="in float32 (not float16)"),
    # ------------------------------------------------------------ GGUF Q4_1 blocks
    Mistake("dequantize_q4_1", "high nibbles first (nibble order swapped)", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed >> 4, packed & 0x0F], axis=1).astype(np.float32)
    return d * q + m
"""),
    Mistake("dequantize_q4_1", "neighbouring weights share a byte (exercise 3's order)", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(blocks), 32)
    return d * q.astype(np.float32) + m
"""),
    Mistake("dequantize_q4_1", "joins the low and high nibbles along the blocks' axis (right for "
            "one block only)", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=0).reshape(len(blocks), 32)
    return d * q.astype(np.float32) + m
""", says="joined along axis 0"),
    Mistake("dequantize_q4_1", "forgets the offset m", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    return d * q
"""),
    Mistake("dequantize_q4_1", "centres the codes around 8 as in Q4_0", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    return d * (q - 8) + m
"""),
    Mistake("dequantize_q4_1", "reads m before d", """
def dequantize_q4_1(blocks):
    m = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    d = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    return d * q + m
"""),
    Mistake("dequantize_q4_1", "subtracts the offset", """
def dequantize_q4_1(blocks):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    return d * q - m
"""),
    # ------------------------------------------------------------ writing Q8_0
    Mistake("quantize_q8_0", "rounds halves to even with np.round", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    q = np.round(x * inv)
    return np.concatenate([d.astype(np.float16).view(np.uint8),
                           q.astype(np.int8).view(np.uint8)], axis=1)
""", says="np.round sends halves to the even neighbour"),
    Mistake("quantize_q8_0", "computes the codes with the float16-rounded scale", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.where(d32 > 0, np.float32(1) / np.where(d32 > 0, d32, np.float32(1)), np.float32(0))
    v = (x * inv).astype(np.float64)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return np.concatenate([d.view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=1)
"""),
    Mistake("quantize_q8_0", "divides by d instead of multiplying by id = 1 / d", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    v = (x / np.where(d > 0, d, np.float32(1))).astype(np.float64)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return np.concatenate([d.astype(np.float16).view(np.uint8),
                           q.astype(np.int8).view(np.uint8)], axis=1)
""", says="multiplies by the reciprocal id = 1 / d"),
    Mistake("quantize_q8_0", "rounds halves away from zero in float32 (floor(|v| + 0.5) without the "
            "float64 cast)", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.float32(1) / np.where(d > 0, d, np.float32(1))
    v = x * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    scale = d.astype(np.float16).view(np.uint8)
    return np.concatenate([scale, q.astype(np.int8).view(np.uint8)], axis=1)
""", says="cast x * id to float64 before adding the 0.5"),
    Mistake("quantize_q8_0", "rounds with trunc(v + 0.5 * sign(v)) in float32", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.float32(1) / np.where(d > 0, d, np.float32(1))
    v = x * inv
    q = np.trunc(v + np.float32(0.5) * np.sign(v))
    scale = d.astype(np.float16).view(np.uint8)
    return np.concatenate([scale, q.astype(np.int8).view(np.uint8)], axis=1)
""", says="0.49999997 + 0.5 is rounded to exactly 1.0"),
    Mistake("quantize_q8_0", "computes d, id and x * id in float64", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float64)
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    inv = 1 / np.where(d > 0, d, 1)
    v = x * inv
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    scale = d.astype(np.float16).view(np.uint8)
    return np.concatenate([scale, q.astype(np.int8).view(np.uint8)], axis=1)
""", says="Keep x, d and id in float32 up to the product"),
    Mistake("quantize_q8_0", "divides by 128", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(128)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    v = (x * inv).astype(np.float64)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return np.concatenate([d.astype(np.float16).view(np.uint8),
                           q.astype(np.int8).view(np.uint8)], axis=1)
"""),
    Mistake("quantize_q8_0", "truncates toward zero instead of rounding", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    q = np.trunc(x * inv)
    return np.concatenate([d.astype(np.float16).view(np.uint8),
                           q.astype(np.int8).view(np.uint8)], axis=1)
""", says="round to the NEAREST integer"),
    Mistake("quantize_q8_0", "the scale from the largest value, not the largest |value|", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = x.max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    v = (x * inv).astype(np.float64)
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), -127, 127)
    return np.concatenate([d.astype(np.float16).view(np.uint8),
                           q.astype(np.int8).view(np.uint8)], axis=1)
"""),
    Mistake("quantize_q8_0", "writes the codes before the scale", """
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    v = (x * inv).astype(np.float64)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return np.concatenate([q.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8)], axis=1)
"""),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "forgets the scale and zero point bytes", "answer_q1 = 0.5\n"),
    Mistake("q1", "counts a byte per code", "answer_q1 = 1 + 5 / 128\n"),
    Mistake("q2", "thinks large weights overflow", 'answer_q2 = "A"\n'),
    Mistake("q3", "thinks weight-only int8 saves FLOPs", 'answer_q3 = "A"\n'),
    Mistake("q4", "forgets the per-token scale", "answer_q4 = 2\n"),
    Mistake("q4", "compares with float32", "answer_q4 = 4 * 128 / 132\n"),
    Mistake("q1", "two decimals where the question asks for three", "answer_q1 = 0.54\n",
            says="round your result to three decimals"),
    Mistake("q4", "one decimal where the question asks for two", "answer_q4 = 1.9\n",
            says="round your result to two decimals"),
    Mistake("q5", "counts the codes only", "answer_q5 = 4\n"),
    Mistake("q5", "forgets the offset m (Q4_0's size)", "answer_q5 = 18 * 8 / 32\n"),
]

# One mistake, one charge: int4_linear is tested with the package's unpack_int4, so a bug in
# the packing exercise leaves it its full marks.
MISTAKES = [replace(m, keeps=("int4_linear",)) if m.grade_id == "pack_int4" else m
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
_SYMMETRIC = ("with scale = max|x| / 127, |round(x / scale)| never exceeds 127, so the clamp "
              "never acts and widening it changes nothing")
EQUIVALENT_MUTANTS: dict[str, str] = {
    "quantize_int8: q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8) => "
    "q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)": _SYMMETRIC,
    "quantize_int8: q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8) => "
    "q = torch.round(w / scale[:, None]).clamp(-127, 128).to(torch.int8)": _SYMMETRIC,
    "quantize_kv: q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8) => "
    "q = torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)": _SYMMETRIC,
    "quantize_kv: q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8) => "
    "q = torch.round(x.float() / scale).clamp(-127, 128).to(torch.int8)": _SYMMETRIC,
    "quantize_int4: q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15) => "
    "q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(-1, 15)":
        "round(w / s) >= round(lo / s) = -round(-lo / s) = -zero, so q is never below 0",
    "quantize_q8_0: x = np.asarray(x, dtype=np.float32) => x = np.asarray(x)":
        "the exercise's input is float32, as the prompt says; the conversion only matters for "
        "other dtypes",
    "quantize_q8_0: inv = np.float32(1) / np.where(d > 0, d, np.float32(1)) => "
    "inv = np.float32(1) / np.where(d > 0, d, np.float32(2))":
        "the stand-in for d = 0 only multiplies a block of zeros: any nonzero one gives codes 0",
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('quantize_int8', 'float64 with multiply by 127/amax', """
def quantize_int8(w):
    w64 = w.double()
    amax = w64.abs().max(dim=1).values
    amax = torch.where(amax == 0, torch.full_like(amax, 127.0), amax)
    q = torch.round(w64 * (127.0 / amax)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, (amax / 127).float()
"""),
    Alternative('quantize_int4', 'unflatten float32', """
def quantize_int4(w, group_size):
    g = w.unflatten(-1, (-1, group_size))
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    zero_range = hi == lo
    scale = torch.where(zero_range, 1.0, (hi - lo) / 15)
    zero = torch.where(zero_range, 0.0, torch.round(-lo / scale))
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return q.flatten(-2).to(torch.uint8), scale, zero.to(torch.uint8)
"""),
    Alternative('pack_int4', 'reshape pairs, multiply by 16, divmod unpack', """
def pack_int4(q):
    pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return (pairs[..., 0] + pairs[..., 1] * 16).to(torch.uint8)

def unpack_int4(packed):
    lo = packed % 16
    hi = packed // 16
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out
"""),
    Alternative('int4_linear', 'group view, einsum, no W materialised', """
def int4_linear(x, packed, scale, zero, group_size):
    q = unpack_int4(packed).float()
    N, K = q.shape
    G = K // group_size
    w = (q.view(N, G, group_size) - zero.float()[..., None]) * scale.float()[..., None]
    return torch.einsum('...k,nk->...n', x.float(), w.reshape(N, K))
"""),
    Alternative('quantize_kv', 'multiply by reciprocal', """
def quantize_kv(x):
    a = x.abs().max(dim=-1, keepdim=True).values
    scale = torch.where(a == 0, torch.ones_like(a), a / 127)
    return torch.round(x * (1 / scale)).to(torch.int8), scale
"""),
    Alternative('dequantize_q8_0', 'loop struct', """
import struct
def dequantize_q8_0(blocks):
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    for i, row in enumerate(blocks):
        d = np.float32(struct.unpack('<e', bytes(row[:2]))[0])
        out[i] = d * row[2:].view(np.int8).astype(np.float32)
    return out
"""),
    Alternative('dequantize_q4_1', 'hstack, m + q*d', """
def dequantize_q4_1(blocks):
    dm = np.ascontiguousarray(blocks[:, :4]).view(np.float16).astype(np.float32)
    d, m = dm[:, :1], dm[:, 1:2]
    codes = blocks[:, 4:20]
    q = np.hstack([codes & 15, codes >> 4]).astype(np.float32)
    return m + q * d
"""),
    Alternative('quantize_q8_0', 'loop per block with python round-half-away', """
import math as _math
def quantize_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], 34), dtype=np.uint8)
    for b in range(x.shape[0]):
        d = np.float32(np.abs(x[b]).max()) / np.float32(127)
        inv = np.float32(1) / d if d != 0 else np.float32(0)
        v = (x[b] * inv).astype(np.float64)
        q = np.array([int(_math.copysign(_math.floor(abs(t) + 0.5), t)) for t in v], dtype=np.int8)
        out[b, :2] = np.array([d], dtype=np.float16).view(np.uint8)
        out[b, 2:] = q.view(np.uint8)
    return out
"""),
    Alternative('q1', 'three decimals, as asked', """
answer_q1 = 0.539
"""),
    Alternative('q4', 'two decimals, as asked', """
answer_q4 = 1.94
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q1', 'a NumPy float32', '''
# Set answer_q1 to a number (bytes per weight).
import numpy as np
answer_q1 = np.float32(0.5) + np.float32(5) / 128
'''),
    Alternative('q4', 'a 0-d torch tensor', '''
# Set answer_q4 to a number.
import torch
answer_q4 = torch.tensor(2.0 * 128) / (128 + 4)
'''),
    Alternative('q5', 'a NumPy int64', '''
# Set answer_q5 to a number (bits per weight).
import numpy as np
answer_q5 = np.int64(20 * 8) // 32
'''),
]
