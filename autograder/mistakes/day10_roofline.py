"""Day 10 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------------ ridge_point
    Mistake("ridge_point", "inverted: bandwidth over peak", """
def ridge_point(peak_flops, bandwidth):
    return bandwidth / peak_flops
""", says="not the other way round"),
    Mistake("ridge_point", "multiplies peak and bandwidth", """
def ridge_point(peak_flops, bandwidth):
    return peak_flops * bandwidth
""", says="not their product"),
    # ------------------------------------------------------------------ attainable_flops
    Mistake("attainable_flops", "divides the bandwidth by the intensity", """
def attainable_flops(peak_flops, bandwidth, intensity):
    return np.minimum(peak_flops, bandwidth / np.asarray(intensity, dtype=np.float64))
"""),
    Mistake("attainable_flops", "max instead of min", """
def attainable_flops(peak_flops, bandwidth, intensity):
    return np.maximum(peak_flops, bandwidth * np.asarray(intensity, dtype=np.float64))
"""),
    Mistake("attainable_flops", "no compute roof: bandwidth x intensity only", """
def attainable_flops(peak_flops, bandwidth, intensity):
    return bandwidth * np.asarray(intensity, dtype=np.float64)
"""),
    Mistake("attainable_flops", "Python min(): fails on an array of intensities", """
def attainable_flops(peak_flops, bandwidth, intensity):
    return min(peak_flops, bandwidth * intensity)
"""),
    # ------------------------------------------------------------------ op_time
    Mistake("op_time", "adds compute and memory time instead of overlapping them", """
def op_time(flops, nbytes, peak_flops, bandwidth):
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return compute + memory, ("compute" if compute >= memory else "memory")
""", says="not their sum"),
    Mistake("op_time", "labels swapped", """
def op_time(flops, nbytes, peak_flops, bandwidth):
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return max(compute, memory), ("memory" if compute >= memory else "compute")
"""),
    Mistake("op_time", "min instead of max: the faster roof", """
def op_time(flops, nbytes, peak_flops, bandwidth):
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return min(compute, memory), ("compute" if compute >= memory else "memory")
""", says="not the faster one"),
    Mistake("op_time", "a tie counts as memory-bound", """
def op_time(flops, nbytes, peak_flops, bandwidth):
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return max(compute, memory), ("compute" if compute > memory else "memory")
"""),
    # ------------------------------------------------------------------ matmul_intensity
    Mistake("matmul_intensity", "1 FLOP per multiply-add", """
def matmul_intensity(m, k, n, bytes_per_element):
    return m * k * n / (bytes_per_element * (m * k + k * n + m * n))
"""),
    Mistake("matmul_intensity", "forgets writing the output", """
def matmul_intensity(m, k, n, bytes_per_element):
    return 2 * m * k * n / (bytes_per_element * (m * k + k * n))
"""),
    Mistake("matmul_intensity", "counts elements, not bytes", """
def matmul_intensity(m, k, n, bytes_per_element):
    return 2 * m * k * n / (m * k + k * n + m * n)
"""),
    Mistake("matmul_intensity", "only the weight matrix's bytes", """
def matmul_intensity(m, k, n, bytes_per_element):
    return 2 * m * k * n / (bytes_per_element * k * n)
"""),
    # ------------------------------------------------------------------ predict_decode_step
    Mistake("predict_decode_step", "weights only: forgets the KV cache", """
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    return op_time(flops.decode_flops(cfg, batch, context_len),
                   flops.weights_read_bytes(cfg, batch, dtype), peak_flops, bandwidth)
""", says="plus every sequence's KV cache"),
    Mistake("predict_decode_step", "reads the weights once per sequence", """
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    nbytes = (batch * flops.weights_read_bytes(cfg, 1, dtype)
              + flops.kv_cache_bytes(cfg, context_len, batch, dtype))
    return op_time(flops.decode_flops(cfg, batch, context_len), nbytes, peak_flops, bandwidth)
""", says="ONCE per step whatever the batch"),
    Mistake("predict_decode_step", "ignores the dtype: always 2 bytes", """
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    return op_time(flops.decode_flops(cfg, batch, context_len),
                   flops.decode_step_bytes(cfg, batch, context_len, "bf16"), peak_flops, bandwidth)
"""),
    # ------------------------------------------------------------------ critical_batch
    Mistake("critical_batch", "the ridge point itself: ignores bytes per weight", """
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    batch = math.ceil(peak_flops / bandwidth)
    return batch if batch <= max_batch else None
"""),
    Mistake("critical_batch", "whole weight_bytes, embedding table included", """
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    for batch in range(1, max_batch + 1):
        _, bound = op_time(batch * per_token, flops.weight_bytes(cfg, dtype), peak_flops,
                           bandwidth)
        if bound == "compute":
            return batch
    return None
"""),
    Mistake("critical_batch", "returns the last memory-bound batch (off by one)", """
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    for batch in range(1, max_batch + 1):
        _, bound = op_time(batch * per_token, flops.weights_read_bytes(cfg, batch, dtype),
                           peak_flops, bandwidth)
        if bound == "compute":
            return batch - 1
    return None
"""),
    Mistake("critical_batch", "returns max_batch instead of None", """
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    for batch in range(1, max_batch + 1):
        _, bound = op_time(batch * per_token, flops.weights_read_bytes(cfg, batch, dtype),
                           peak_flops, bandwidth)
        if bound == "compute":
            return batch
    return max_batch
"""),
    Mistake("attainable_flops", "multiplies the caller's array of intensities in place", """
def attainable_flops(peak_flops, bandwidth, intensity):
    if isinstance(intensity, np.ndarray):
        intensity *= bandwidth
        return np.minimum(peak_flops, intensity)
    return min(peak_flops, bandwidth * intensity)
""", says="in-place"),
    Mistake("predict_decode_step", "weight_bytes (the whole embedding table) + kv_cache_bytes", """
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    nbytes = flops.weight_bytes(cfg, dtype) + flops.kv_cache_bytes(cfg, context_len, batch, dtype)
    return op_time(flops.decode_flops(cfg, batch, context_len), nbytes, peak_flops, bandwidth)
""", says="weight_bytes would count the whole table"),
    Mistake("predict_decode_step", "a KV cache of context_len - 1 tokens (the cache before the step)", """
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    return op_time(flops.decode_flops(cfg, batch, context_len),
                   flops.decode_step_bytes(cfg, batch, context_len - 1, dtype), peak_flops, bandwidth)
""", says="not context_len - 1"),
    Mistake("critical_batch", "compares the two times inline with a strict >: a tie counts as "
            "memory-bound", """
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    for batch in range(1, max_batch + 1):
        if batch * per_token / peak_flops > flops.weights_read_bytes(cfg, batch, dtype) / bandwidth:
            return batch
    return None
""", says="a tie counts as compute-bound"),
    # ------------------------------------------------------------------ self-check
    Mistake("q1", "thinks intensity 50 is compute-bound", 'answer_q1 = "A"'),
    Mistake("q1", "divides bandwidth by intensity", 'answer_q1 = "C"'),
    Mistake("q2", "used the H100's 3.35 TB/s", """
answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 1, "bf16") / 3.35e12 * 1e3
"""),
    Mistake("q2", "computed the compute time instead", """
answer_q2 = flops.decode_flops(P["llama-2-70b"], 1, 1) / 989.4e12 * 1e3
"""),
    Mistake("q2", "answered in seconds", """
answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 1, "bf16") / 4.8e12
"""),
    Mistake("q2", "the H200's memory capacity (141 GB) over its bandwidth", """
answer_q2 = 141e9 / 4.8e12 * 1e3
""", says="memory capacity"),
    Mistake("q2", "the nominal 140 GB of Llama-2-70B's weights over the bandwidth", """
answer_q2 = 140e9 / 4.8e12 * 1e3
""", says="nominal 140 GB"),
    Mistake("q3", "thinks the step time scales with batch", 'answer_q3 = "A"'),
    Mistake("q3", "thinks batch 16 is compute-bound", 'answer_q3 = "D"'),
]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'attainable_flops: return np.minimum(peak_flops, bandwidth * np.asarray(intensity, dtype=np.float64)) => return np.minimum(peak_flops, bandwidth * np.asarray(intensity))':
        'the float bandwidth makes the product float64 anyway',
    'q2: answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 1, "bf16") / 4.8e12 * 1e3 => answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 2, 1, "bf16") / 4.8e12 * 1e3':
        "within the question's stated tolerance (the step reads the weights once; one more sequence's cache is a rounding error)",
    'q2: answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 1, "bf16") / 4.8e12 * 1e3 => answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 2, "bf16") / 4.8e12 * 1e3':
        "within the question's stated tolerance (one more cached token is a rounding error next to the weights)",
}

# One mistake, one charge: predict_decode_step and critical_batch are tested with the package's
# op_time swapped in, so a bug in op_time leaves them their full marks.
MISTAKES = [replace(m, keeps=("predict_decode_step", "critical_batch"))
            if m.name in ("labels swapped", "a tie counts as memory-bound") else m
            for m in MISTAKES]

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('predict_decode_step', 'keyword call to op_time', '''
def predict_decode_step(cfg, batch, context_len, dtype, peak_flops, bandwidth):
    return op_time(flops=flops.decode_flops(cfg, batch, context_len),
                   nbytes=flops.decode_step_bytes(cfg, batch, context_len, dtype),
                   peak_flops=peak_flops, bandwidth=bandwidth)
'''),
    Alternative('critical_batch', 'keyword call to op_time', '''
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    for b in range(1, max_batch + 1):
        _, bound = op_time(flops=b * per_token, nbytes=flops.weights_read_bytes(cfg, b, dtype),
                           peak_flops=peak_flops, bandwidth=bandwidth)
        if bound == "compute":
            return b
    return None
'''),
    Alternative('attainable_flops', 'np.clip', '''
def attainable_flops(peak_flops, bandwidth, intensity):
    return np.clip(bandwidth * np.asarray(intensity, dtype=float), None, peak_flops)
'''),
    Alternative('op_time', 'cross-multiplied comparison', '''
def op_time(flops, nbytes, peak_flops, bandwidth):
    t = max(flops / peak_flops, nbytes / bandwidth)
    bound = "compute" if flops * bandwidth >= nbytes * peak_flops else "memory"
    return t, bound
'''),
    Alternative('critical_batch', 'binary search with op_time', '''
def critical_batch(cfg, dtype, peak_flops, bandwidth, max_batch=100_000):
    per_token = flops.weight_flops_per_token(cfg)
    def compute_bound(b):
        return op_time(b * per_token, flops.weights_read_bytes(cfg, b, dtype), peak_flops, bandwidth)[1] == "compute"
    if not compute_bound(max_batch):
        return None
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
'''),
    Alternative('q2', 'via HARDWARE', '''
answer_q2 = flops.decode_step_bytes(P["llama-2-70b"], 1, 1, "bf16") / HARDWARE["h200"].bandwidth * 1e3'''),
]
