"""Interval-set arithmetic on [start, end) pairs: the algebra of the step-time breakdown."""

Intervals = list[tuple[float, float]]


def union(iv: Intervals) -> Intervals:
    """Disjoint, sorted cover of the given intervals."""
    out: Intervals = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def measure(iv: Intervals) -> float:
    return sum(e - s for s, e in iv)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Both disjoint and sorted (as `union` returns them)."""
    i = j = 0
    out: Intervals = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b, both disjoint and sorted."""
    out: Intervals = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    return [(max(s, lo), min(e, hi)) for s, e in iv if e > lo and s < hi]
