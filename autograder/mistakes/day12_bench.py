"""Day 12 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

_CHECKS = """
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("token_times must hold at least one timestamp")
    if times[0] < start or any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("bad trace")
"""

_GOODPUT_HEAD = """
def goodput(requests, ttft_slo, tpot_slo, duration):
    for name, value in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo), ("duration", duration)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0")
    good = 0
    for start, times in requests:
        ttft, _ = ttft_and_itls(start, times)
        tpot, _ = tpot_and_e2e(start, times)
"""

MISTAKES = [
    # ---------------------------------------------------------------- TTFT and ITLs
    Mistake("ttft_itls", "TTFT is the first timestamp itself (start not subtracted)",
            "def ttft_and_itls(start, token_times):" + _CHECKS + """
    return times[0], [b - a for a, b in zip(times, times[1:])]
"""),
    Mistake("ttft_itls", "counts the wait for the first token as an ITL (n gaps)",
            "def ttft_and_itls(start, token_times):" + _CHECKS + """
    gaps = [b - a for a, b in zip([start] + times, times)]
    return times[0] - start, gaps
"""),
    Mistake("ttft_itls", "ITLs measured from the submission time (cumulative)",
            "def ttft_and_itls(start, token_times):" + _CHECKS + """
    return times[0] - start, [t - start for t in times[1:]]
"""),
    Mistake("ttft_itls", "no validation: a malformed trace gives numbers", """
def ttft_and_itls(start, token_times):
    times = [float(t) for t in token_times]
    if not times:
        return 0.0, []
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]
"""),
    Mistake("ttft_itls", "order check compares only the last time with the first", """
def ttft_and_itls(start, token_times):
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("token_times must hold at least one timestamp")
    if times[0] < start:
        raise ValueError("the first token is before start")
    if times[-1] < times[0]:
        raise ValueError("token_times go backwards")
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]
""", says="every consecutive pair"),
    Mistake("ttft_itls", "order check looks at the first gap only", """
def ttft_and_itls(start, token_times):
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("token_times must hold at least one timestamp")
    if times[0] < start:
        raise ValueError("the first token is before start")
    if len(times) > 1 and times[1] < times[0]:
        raise ValueError("token_times go backwards")
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]
""", says="every consecutive pair"),
    Mistake("ttft_itls", "rejects two tokens with the same timestamp (strict order)", """
def ttft_and_itls(start, token_times):
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("token_times must hold at least one timestamp")
    if times[0] < start or any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("bad trace")
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]
""", says="a gap of 0"),
    # ---------------------------------------------------------------- TPOT and e2e
    Mistake("tpot_e2e", "TPOT as e2e / n: the prefill mixed into the per-token figure", """
def tpot_and_e2e(start, token_times):
    ttft_and_itls(start, token_times)
    e2e = float(token_times[-1]) - start
    return e2e / len(token_times), e2e
"""),
    Mistake("tpot_e2e", "divides the decode span by n instead of n - 1", """
def tpot_and_e2e(start, token_times):
    ttft_and_itls(start, token_times)
    n = len(token_times)
    tpot = (token_times[-1] - token_times[0]) / n if n > 1 else None
    return tpot, float(token_times[-1]) - start
"""),
    Mistake("tpot_e2e", "a one-token response gets TPOT 0 instead of None", """
def tpot_and_e2e(start, token_times):
    _, itls = ttft_and_itls(start, token_times)
    tpot = sum(itls) / len(itls) if itls else 0.0
    return tpot, float(token_times[-1]) - start
"""),
    Mistake("tpot_e2e", "end-to-end measured from the first token, not the submission", """
def tpot_and_e2e(start, token_times):
    _, itls = ttft_and_itls(start, token_times)
    tpot = sum(itls) / len(itls) if itls else None
    return tpot, float(token_times[-1]) - float(token_times[0])
"""),
    Mistake("tpot_e2e", "computes from the raw times without validating the trace", """
def tpot_and_e2e(start, token_times):
    if not token_times:
        raise ValueError("token_times must not be empty")
    n = len(token_times)
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None
    return tpot, float(token_times[-1]) - start
""", says="ttft_and_itls"),
    # ---------------------------------------------------------------- percentile
    Mistake("percentile", "nearest-rank instead of linear interpolation", """
def percentile(values, q):
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
""", says="20 is what nearest-rank"),
    Mistake("percentile", "position q/100 * N instead of q/100 * (N - 1)", """
def percentile(values, q):
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    r = min(q / 100 * len(ordered), len(ordered) - 1)
    low = math.floor(r)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (r - low) * (ordered[high] - ordered[low])
"""),
    Mistake("percentile", "forgets to sort", """
def percentile(values, q):
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = [float(v) for v in values]
    if not ordered:
        raise ValueError("values must not be empty")
    r = q / 100 * (len(ordered) - 1)
    low = math.floor(r)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (r - low) * (ordered[high] - ordered[low])
"""),
    Mistake("percentile", "takes the lower neighbour without interpolating", """
def percentile(values, q):
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    return ordered[math.floor(q / 100 * (len(ordered) - 1))]
""", says="the lower neighbour alone"),
    Mistake("percentile", "sorts the caller's list in place", """
def percentile(values, q):
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    if len(values) == 0:
        raise ValueError("values must not be empty")
    values.sort()
    r = q / 100 * (len(values) - 1)
    low = math.floor(r)
    high = min(low + 1, len(values) - 1)
    return float(values[low] + (r - low) * (values[high] - values[low]))
"""),
    Mistake("percentile", "silently clamps q into [0, 100]", """
def percentile(values, q):
    q = min(max(q, 0), 100)
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    r = q / 100 * (len(ordered) - 1)
    low = math.floor(r)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (r - low) * (ordered[high] - ordered[low])
"""),
    # ---------------------------------------------------------------- goodput
    Mistake("goodput", "counts a request meeting EITHER objective", _GOODPUT_HEAD + """
        if ttft <= ttft_slo or (tpot is None or tpot <= tpot_slo):
            good += 1
    return good / duration
"""),
    Mistake("goodput", "strict < : a request exactly at the limit fails", _GOODPUT_HEAD + """
        if ttft < ttft_slo and (tpot is None or tpot < tpot_slo):
            good += 1
    return good / duration
"""),
    Mistake("goodput", "a one-token request (no TPOT) never counts", _GOODPUT_HEAD + """
        if tpot is not None and ttft <= ttft_slo and tpot <= tpot_slo:
            good += 1
    return good / duration
"""),
    Mistake("goodput", "returns the fraction of good requests, not a rate per second",
            _GOODPUT_HEAD + """
        if ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo):
            good += 1
    return good / max(len(requests), 1)
""", says="not by the number of requests"),
    Mistake("goodput", "counts good tokens instead of good requests", _GOODPUT_HEAD + """
        if ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo):
            good += len(times)
    return good / duration
"""),
    # ---------------------------------------------------------------- throughput
    Mistake("throughput", "averages each request's own tokens per second", """
def output_throughput(requests):
    if not requests:
        raise ValueError("requests must not be empty")
    return sum(len(t) / (t[-1] - s) for s, t in requests) / len(requests)
"""),
    Mistake("throughput", "divides by the sum of the requests' latencies", """
def output_throughput(requests):
    if not requests:
        raise ValueError("requests must not be empty")
    return sum(len(t) for _, t in requests) / sum(t[-1] - s for s, t in requests)
"""),
    Mistake("throughput", "span from the first request in the list to the last one's end", """
def output_throughput(requests):
    if not requests:
        raise ValueError("requests must not be empty")
    return sum(len(t) for _, t in requests) / (requests[-1][1][-1] - requests[0][0])
"""),
    Mistake("throughput", "no check for an empty list: max() raises its own ValueError", """
def output_throughput(requests):
    tokens = sum(len(t) for _, t in requests)
    return tokens / (max(t[-1] for _, t in requests) - min(s for s, _ in requests))
""", says="max() or min() over nothing"),
    # ---------------------------------------------------------------- self-check
    Mistake("q1", "looks at the streaming speed", """
answer_q1 = "A"
"""),
    Mistake("q2", "TTFT + n x TPOT (counts the first token twice)", """
answer_q2 = 300 + 50 * 20
"""),
    Mistake("q2", "n x TPOT only, forgetting the TTFT", """
answer_q2 = 50 * 20
"""),
    Mistake("q3", "reads p99 as the typical value", """
answer_q3 = "A"
"""),
    Mistake("q4", "goodput follows throughput", """
answer_q4 = "A"
"""),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'TTFT is the first timestamp itself': ('tpot_e2e', 'goodput'),
    'divides the decode span by n instead of n - 1': ('goodput',),
    'order check compares only the last time with the first': ('tpot_e2e', 'goodput'),
    'order check looks at the first gap only': ('tpot_e2e', 'goodput'),
    'rejects two tokens with the same timestamp': ('tpot_e2e', 'goodput'),
    'computes from the raw times without validating the trace': ('goodput',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('throughput', 'message without the word requests', """
def output_throughput(requests):
    if len(requests) == 0:
        raise ValueError("output_throughput needs at least one request")
    first = min(s for s, _ in requests)
    last = max(max(t) for _, t in requests)
    return sum(map(len, (t for _, t in requests))) / (last - first)
"""),
    Alternative('percentile', 'manual interpolation on a (float32) torch tensor', """
def percentile(values, q):
    if len(values) == 0:
        raise ValueError("values must not be empty")
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    v = torch.sort(torch.tensor([float(x) for x in values])).values
    r = q / 100 * (len(v) - 1)
    lo = int(r)
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (r - lo) * (v[hi] - v[lo]))
"""),
    Alternative('percentile', 'torch.quantile float32', """
def percentile(values, q):
    if len(values) == 0 or not 0 <= q <= 100:
        raise ValueError("values must be non-empty and q in [0, 100]")
    return float(torch.quantile(torch.tensor(values, dtype=torch.float32), q / 100))
"""),
    Alternative('ttft_itls', 'np.diff, sorted check', """
def ttft_and_itls(start, token_times):
    if len(token_times) == 0:
        raise ValueError("token_times is empty")
    if list(token_times) != sorted(token_times):
        raise ValueError("token_times must not decrease")
    if token_times[0] < start:
        raise ValueError("first token before start")
    return float(token_times[0] - start), np.diff(np.asarray(token_times, dtype=float)).tolist()
"""),
    Alternative('tpot_e2e', 'statistics.mean, e2e = ttft + sum', """
import statistics
def tpot_and_e2e(start, token_times):
    ttft, itls = ttft_and_itls(start, token_times)
    return (statistics.fmean(itls) if itls else None), ttft + math.fsum(itls)
"""),
    Alternative('percentile', 'divmod on r', """
def percentile(values, q):
    if not values:
        raise ValueError("empty values")
    if not (0 <= q <= 100):
        raise ValueError("q out of range")
    s = sorted(values)
    r = q * (len(s) - 1) / 100.0
    i, frac = divmod(r, 1)
    i = int(i)
    if i + 1 >= len(s):
        return float(s[-1])
    return s[i] + frac * (s[i + 1] - s[i])
"""),
    Alternative('goodput', 'float() of a count, generator', """
def goodput(requests, ttft_slo, tpot_slo, duration):
    for n, v in dict(duration=duration, ttft_slo=ttft_slo, tpot_slo=tpot_slo).items():
        if v <= 0: raise ValueError(f"{n} must be positive")
    def meets(req):
        s, t = req
        tpot, _ = tpot_and_e2e(s, t)
        return ttft_and_itls(s, t)[0] <= ttft_slo and (tpot is None or tpot <= tpot_slo)
    return float(sum(1 for r in requests if meets(r))) / duration
"""),
    Alternative('throughput', 'numpy', """
def output_throughput(requests):
    if not requests:
        raise ValueError("requests is empty")
    starts = np.array([s for s, _ in requests]); ends = np.array([t[-1] for _, t in requests])
    return float(np.sum([len(t) for _, t in requests]) / (ends.max() - starts.min()))
"""),
    Alternative('q2', 'float', """
answer_q2 = 300.0 + 49 * 20.0
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy int64 (computed with numpy)', '''
# Set answer_q2 to a number (milliseconds).
import numpy as np
answer_q2 = np.int64(300) + np.int64(50 - 1) * 20
'''),
]
