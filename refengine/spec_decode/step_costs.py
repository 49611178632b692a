"""The step-cost model of adaptive speculation: what a verify, a draft and a plain decode step cost. Per step
shape a measured time (timed graph replays at start-up, then a moving average of the runner's GPU-synchronised
step times); for shapes never measured, linear functions of the shape fitted online by decayed least squares
with a prior.

- V(N, R) = v0 + v1*N + v2*R: a verify of N requests computing R rows (on the GPU: its graph shape's rows);
- D(M) = d0 + d1*M: a draft for M requests (0 when M = 0). Its table is also keyed by the draft graph's score
  cap, the LM head's rows a block (runner/graphs.py): `draft_s(m, widest)` for a step whose largest span is
  `widest` (0: the full block's shape, the fit's samples). With graphs, a shape's time is its start-up replay
  plus X(M) = x0 + x1*bucket(M), what a real draft adds to a replay (the host's block layout, attention
  planning and context loading, while the device waits: ~0.3 ms + ~24 us a request on the H200, run 126),
  fitted over every draft sample of every shape (_observe_draft);
- P(N) = p0 + p1*N: a plain decode step of N requests (every span 1: no draft, the one-row decode graph);
- H_verify(N), H_plain(N) = h0 + h1*N: the host's own time a step of that kind takes, outside the runner's
  synchronised work (the scheduler's choice, the commit's per-request bookkeeping): 0 until observed. On the
  H200 at c32 an adaptive verify step's was ~1.0 ms against a plain step's ~0.14 (run 110), ~10% of a verify
  step the choice did not price (docs/PERF.md, twenty-third session);
- C(R) = c0 + c1*R: a catch-up, the projection of R context rows carried past a plain stretch (0 until one
  was seen). Mostly fixed: run eagerly it cost 7.7-8.8 ms however few rows at c1..c16 (H200, Qwen3-4B
  shapes, run 40); replayed from catch-up graphs (runner/catch_up_graphs.py) 0.44-0.55 ms for 101-228 rows
  and 2.1-3.3 ms for 3232-4128 (run 43). Priced per row alone it looked 27-42 us a row from short
  stretches and overpriced long ones (docs/PERF.md).
P is its own curve because the decode graph is not the verify graph at one row per request. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

TABLE_WEIGHT = 0.2  # a step's weight in its shape's moving average
SPIKE = 2.0  # a sample counts for at most this multiple of the current estimate
MIN_STEP_S = 1e-6  # a step's time in the tables is at least this: a 0 s sample (a mocked runner, a coarse
# clock) must not make a shape free (choose_spans divides by the plain step's time)
SOLVE_EVERY = 4  # after the first few samples, the fit is re-solved every SOLVE_EVERY-th
FORGET = 0.98  # per sample: old samples fade over ~50 updates of a curve
# Prior variances (ms^2) of (per step, per request, per row): a step's cost is mostly fixed (memory-bound), so
# the intercept is free to move and the slopes move slowly unless the data insist.
VAR_STEP, VAR_REQUEST, VAR_ROW = 100.0, 1.0, 0.01
VAR_CATCH_UP_ROW = 1e-4  # a catch-up row: prior 2 us, sd 10 us (a row is a gather and a few GEMM rows)
VAR_EXTRA, VAR_EXTRA_REQUEST = 1.0, 0.01  # a real draft over its replay (ms^2): ~0.3-1.1 ms, ~0.02 ms a request
VAR_HOST, VAR_HOST_REQUEST = 1.0, 0.01  # a step's host time (ms^2): ~0.05-1 ms, ~0.02 ms a request
HOST_KINDS = ("verify", "plain")  # a speculating step's host time, and a plain (all spans 1) step's


class _Fit:
    """Least squares y ~ theta . x over exponentially decayed samples (FORGET per sample), regularised by a
    fixed Gaussian prior (mean theta0, the given variances), kept as sufficient statistics and re-solved per
    sample. Unlike textbook recursive least squares with forgetting, nothing winds up: a direction the data
    never excite (every step at one batch size) falls back to the prior instead of growing without bound.
    Plain Python, dimension 2 or 3."""

    def __init__(self, theta: list[float], variances: list[float]):
        n = len(theta)
        self.theta, self.theta0 = list(theta), list(theta)
        self.precision0 = [1.0 / v for v in variances]
        self.sxx = [[0.0] * n for _ in range(n)]
        self.sxy = [0.0] * n
        self.updates = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: list[float], y: float) -> bool:
        """Add a sample; True when theta was re-solved (every sample at first, then every SOLVE_EVERY-th)."""
        f = FORGET
        self.sxy = [f * s + xi * y for s, xi in zip(self.sxy, x)]
        self.sxx = [[f * s + xi * xj for s, xj in zip(row, x)] for row, xi in zip(self.sxx, x)]
        self.updates += 1
        if self.updates > SOLVE_EVERY and self.updates % SOLVE_EVERY:
            return False  # the sums are current; re-solving every few samples is plenty (and saves host time)
        n = len(x)
        a = [[self.sxx[i][j] + (self.precision0[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self.sxy[i] + self.precision0[i] * self.theta0[i] for i in range(n)]
        self.theta = _solve(a, b)
        return True


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive definite a (Gaussian elimination, partial pivoting; 2 x 2 in
    closed form: the plain-decode fit re-solves every few plain steps, and the loop cost ~14 us there)."""
    n = len(b)
    if n == 2:
        (a00, a01), (a10, a11) = a
        det = a00 * a11 - a01 * a10  # > 0: a is the prior's precision plus a Gram matrix
        return [(b[0] * a11 - a01 * b[1]) / det, (a00 * b[1] - a10 * b[0]) / det]
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _same(n: int) -> int:
    return n


def _bucket_of(draft_key) -> int:
    """The batch bucket of a draft table key: a bucket (the full block's shape) or (bucket, score cap)."""
    return draft_key[0] if isinstance(draft_key, tuple) else draft_key


def _one_shape(widest: int) -> int | None:
    """No score caps (an eager drafter): every draft scores the full block."""
    return None


@dataclass
class CostModel:
    """V(N, R), D(M), P(N) in seconds: per step shape, a table of measured times (seeded from timed graph
    replays at start-up, then an exponential moving average of the steps of that shape, TABLE_WEIGHT each);
    shapes never measured fall back to linear fits in milliseconds (the prior variances assume unit noise:
    ~1 ms; priors: a memory-bound step where the fixed cost dominates, drafts cheaper). `bucket` /
    `draft_bucket` map a request count to the batch shape its step runs (graph buckets; eager: itself)."""

    verify: _Fit = field(default_factory=lambda: _Fit([5.0, 0.05, 0.02], [VAR_STEP, VAR_REQUEST, VAR_ROW]))
    draft: _Fit = field(default_factory=lambda: _Fit([2.0, 0.1], [VAR_STEP, VAR_REQUEST]))
    plain: _Fit = field(default_factory=lambda: _Fit([5.0, 0.07], [VAR_STEP, VAR_REQUEST]))
    catch_up: _Fit = field(default_factory=lambda: _Fit([0.5, 0.002], [VAR_STEP, VAR_CATCH_UP_ROW]))
    bucket: Callable[[int], int] = _same
    draft_bucket: Callable[[int], int] = _same
    draft_cap: Callable[[int], int | None] = _one_shape  # largest span -> the draft's score cap (None: full)
    tables: dict[str, dict] = field(default_factory=lambda: {"verify": {}, "draft": {}, "plain": {}})
    # X(M): what a real draft of the bucket of M requests takes beyond its shape's replay (ms), over every shape
    draft_extra: _Fit = field(default_factory=lambda: _Fit([0.0, 0.0], [VAR_EXTRA, VAR_EXTRA_REQUEST]))
    draft_replays: dict = field(default_factory=dict)  # draft table key -> its start-up replay (s)
    host: dict[str, _Fit] = field(
        default_factory=lambda: {k: _Fit([0.0, 0.0], [VAR_HOST, VAR_HOST_REQUEST]) for k in HOST_KINDS}
    )
    price_host: bool = False  # measure the host's time a step (Engine.step) and price it in the choice (host_s)

    @classmethod
    def linear(
        cls, v0: float, v1: float, v2: float, d0: float, d1: float, p0: float | None = None, p1: float | None = None
    ) -> CostModel:
        """A given model (tests, calibration results), also the prior later samples are fitted against; plain
        decode defaults to V(N, N)."""
        m = cls()
        p0, p1 = v0 if p0 is None else p0, v1 + v2 if p1 is None else p1
        for fit, theta in (
            (m.verify, [v0 * 1e3, v1 * 1e3, v2 * 1e3]),
            (m.draft, [d0 * 1e3, d1 * 1e3]),
            (m.plain, [p0 * 1e3, p1 * 1e3]),
        ):
            fit.theta, fit.theta0 = list(theta), list(theta)
        return m

    def plain_s(self, n: int) -> float:
        t = self.tables["plain"].get(self.bucket(n))
        return t if t is not None else max(self.plain.predict([1.0, n]), 1e-3) * 1e-3

    def verify_s(self, n: int, rows: int) -> float:
        t = self.tables["verify"].get((self.bucket(n), rows))
        return t if t is not None else max(self.verify.predict([1.0, n, rows]), 1e-3) * 1e-3

    def draft_key(self, m: int, widest: int = 0):
        """The draft table's key of m drafting requests whose largest span is `widest`: the bucket (the full
        block's shape; widest 0 means that one), or (bucket, score cap) for a narrower one."""
        cap = self.draft_cap(widest) if widest else None
        return self.draft_bucket(m) if cap is None else (self.draft_bucket(m), cap)

    def draft_s(self, m: int, widest: int = 0) -> float:
        """D(m) of a draft whose largest span is `widest` (0: the full block's shape). A narrower shape never
        timed is priced as the full one (the fit knows only those)."""
        if not m:
            return 0.0
        t = self._draft_table_s(self.draft_bucket(m), self.draft_cap(widest) if widest else None)
        return t if t is not None else max(self.draft.predict([1.0, m]), 0.0) * 1e-3

    def draft_costs(self, n: int, widest: int = 0) -> list[float]:
        """[D(0), D(1), ..., D(n)]: draft_s(m, widest) over a batch's drafting counts in one pass (the span
        search prices every count each speculating step; 33 draft_s calls were ~0.1 ms of a c32 step on a
        2-core CPU)."""
        bucket, cap = self.draft_bucket, self.draft_cap(widest) if widest else None
        d0, d1 = self.draft.theta
        out = [0.0]
        for m in range(1, n + 1):
            t = self._draft_table_s(bucket(m), cap)
            out.append(t if t is not None else max(d0 + d1 * m, 0.0) * 1e-3)
        return out

    def _draft_table_s(self, bucket: int, cap: int | None) -> float | None:
        """The draft table's time of a bucket at a score cap (None: the full block's); a narrower cap never
        timed falls back to the full block's shape. None when neither was measured (the fit prices it)."""
        table = self.tables["draft"]
        t = table.get(bucket if cap is None else (bucket, cap))
        return table.get(bucket) if t is None and cap is not None else t

    def host_s(self, kind: str, n: int, regime: bool = False) -> float:
        """H_kind(n) (HOST_KINDS) as the choice prices it: 0 unless `price_host`, and until a step of that kind
        was observed. Off by default: on the H200, paired round by round, pricing it gained nothing beyond noise
        and once fell into the small-batch trap (a choice held plain on an estimate's dip): docs/PERF.md,
        twenty-fourth session; priced in the choice in large batches only, it held half of the sharegpt
        profile's c32 steps plain while awake (0.963 of plain against 1.047: H200 runs 155-156). `regime`: as a
        large batch's plain-regime test prices a uniform batch's speculating step (Retirement._find_plain_regime),
        with H_verify whenever measured (CostSamples times every verify step from its choice): without it the
        trained tiny pair's c8 waves on the H200 (verify steps 2-3 ms against 0.5 ms plain ones, 0.2-0.8 ms of
        it host) read speculation as winning on stale rates, and each new batch size's first waves woke a
        dormant policy (run 152). Not H_plain: a timed plain step is one whose spans were chosen, dearer than
        the plain stretch's steps the alternative would run (priced, it read 0.23 + 0.007 n ms: run 154b)."""
        if self.price_host or (regime and kind == "verify"):
            return self.host_fit_s(kind, n)
        return 0.0

    def plain_step_s(self, n: int) -> float:
        """A plain decode step of n requests as the policy prices it: P(n) + H_plain(n)."""
        return self.plain_s(n) + self.host_s("plain", n)

    def host_fit_s(self, kind: str, n: float) -> float:
        """H_kind(n) as measured, priced or not (0 until a step of that kind was observed)."""
        fit = self.host[kind]
        return max(fit.predict([1.0, n]), 0.0) * 1e-3 if fit.updates else 0.0

    def observe_host(self, kind: str, n: float, seconds: float) -> None:
        """The mean host time of steps of a kind and their mean request count; capped at SPIKE x the estimate
        (a garbage-collector pause), once there is one."""
        current = self.host_fit_s(kind, n)
        if current > 0.0:
            seconds = min(seconds, SPIKE * current)
        self.host[kind].update([1.0, n], seconds * 1e3)

    def catch_up_s(self, rows: int) -> float:
        """C(rows): 0 for no rows, or until a catch-up was observed (nothing to price it by yet)."""
        if not rows or not self.catch_up.updates:
            return 0.0
        return max(self.catch_up.predict([1.0, rows]), 0.0) * 1e-3

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        self.catch_up.update([1.0, rows], seconds * 1e3)

    def observe(self, n: int, rows: int, drafted: int, draft_s: float, verify_s: float, widest: int = 0) -> None:
        """One step of n requests computing `rows` rows (`drafted` of them drafting, the largest span
        `widest`), and its times. A sample over SPIKE x the current estimate (a garbage-collector pause,
        another process on the device) counts as SPIKE x: one stall must not make a shape look slow for the
        next dozens of steps. The draft fit learns from the full block's shape only."""
        if not drafted and rows == n:
            verify_s = min(verify_s, SPIKE * self.plain_s(n))
            self.plain.update([1.0, n], verify_s * 1e3)
            self._average("plain", self.bucket(n), verify_s)
            return
        verify_s = min(verify_s, SPIKE * self.verify_s(n, rows))
        draft_s = min(draft_s, SPIKE * self.draft_s(drafted, widest)) if drafted else draft_s
        self.verify.update([1.0, n, rows], verify_s * 1e3)
        self._average("verify", (self.bucket(n), rows), verify_s)
        if drafted:
            key = self.draft_key(drafted, widest)
            if not isinstance(key, tuple):
                self.draft.update([1.0, drafted], draft_s * 1e3)
            self._observe_draft(key, draft_s)

    def seed(self, kind: str, key, seconds: float) -> None:
        """A timed replay of one shape: 'plain' (bucket), 'verify' ((bucket, rows)) or 'draft' (bucket, or
        (bucket, score cap) for a narrower score cap than the block's: only the table learns those). A draft
        shape's table time is then its replay plus X(bucket), as learnt so far (_observe_draft)."""
        if kind == "draft":
            self.draft_replays[key] = seconds
            self.tables["draft"][key] = self._replay_plus_extra(key)
            if isinstance(key, tuple):
                return
        else:
            self.tables[kind][key] = max(seconds, MIN_STEP_S)
        x = [1.0, key[0], key[1]] if kind == "verify" else [1.0, key]
        getattr(self, kind).update(x, seconds * 1e3)

    def _observe_draft(self, key, seconds: float) -> None:
        """A draft sample: a shape timed at start-up teaches X (every such shape's time is then its replay plus
        X of its bucket); another one (eager, no graph) is averaged into its own table entry. Why pooled: each
        shape averaged alone, a few slow steps (a sample counts up to SPIKE x) priced bucket 32's cap 4 above
        its cap 8; the policy then drafted spans of 5 or decoded plainly, nothing measured cap 4 again, and
        sharegpt c32 waves ran 0.927 of plain against 1.05-1.07 on paths where that had not happened (H200,
        run 127). The real-minus-replay times of 21 shapes lay on one line (run 126, docs/PERF.md)."""
        replay = self.draft_replays.get(key)
        if replay is None:
            self._average("draft", key, seconds)
            return
        if self.draft_extra.update([1.0, _bucket_of(key)], (seconds - replay) * 1e3):  # re-solved: re-price
            table = self.tables["draft"]
            for k in self.draft_replays:
                table[k] = self._replay_plus_extra(k)

    def _replay_plus_extra(self, key) -> float:
        x0, x1 = self.draft_extra.theta
        return max(self.draft_replays[key] + (x0 + x1 * _bucket_of(key)) * 1e-3, MIN_STEP_S)

    def _average(self, kind: str, key, seconds: float) -> None:
        old, seconds = self.tables[kind].get(key), max(seconds, MIN_STEP_S)
        self.tables[kind][key] = seconds if old is None else old + TABLE_WEIGHT * (seconds - old)
