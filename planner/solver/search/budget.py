"""Work budgets: a search step's allowance counted in work done, not seconds, so a loaded machine plans the same.

Each operation a step repeats is charged a fixed estimate from its size (the ``*_units`` functions: microseconds of
CPU on the development machine), and a nominal second of budget is ``UNITS_PER_S`` of them: what a second of wall
time did there under its usual load (two cores shared by several processes). So ``--time-limit S`` does about
``S`` seconds of work there, and the same work anywhere. The wall clock stays only as a ceiling
(``CEILING_FACTOR`` times the nominal time of the whole solve): past it every step stops, and the stop is recorded
(``watch_ceiling``) so the plan can say it may differ from a quiet machine's.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Callable, Iterator

UNITS_PER_S = 400_000  # CPU microseconds per nominal second: wall time ran ~2.5x CPU time there
CEILING_FACTOR = 3.0  # the wall-clock safety stop, as a multiple of the nominal time
CEILING_SLACK_S = 2.0  # added to the ceiling: start-up costs (kernel loading) that no budget counts
# CP-SAT's deterministic time per nominal second (its limit and its charge). Fitted 2026-12-06 on the CPU time
# (solver.user_time; the process's CPU rose by as much) of the 8 main CP-SAT solves of DT-FM
# worldwide (plan_time's case at 30 s, loads 3-5). At 0.3: 9.3 s of CPU for 2.8 det s (CPU per det s median 3.2,
# p10 2.6, p90 4.2), measured / charged median 2.38, p10 1.93, p90 3.12, total 2.49: +5.6 s of CPU, half of what
# the whole solve ran past its charges. At 0.12 (a det s ~3.3 CPU s, 8.3 nominal s): 4.4 s for 1.1 det s, median
# 1.11, p10 0.92, p90 1.47, total 1.18; the same plan (14,888.9 ms). The hint's completions (~0.002 det s) cost a
# fixed ~40 ms each that no det time counts. Before: 0.3, from wall time ("one of its seconds took about three
# of wall time there"). The 1000x176 pool never reaches CP-SAT (too large: its local search instead).
CPSAT_DET_PER_S = 0.12

_hits: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("stagewise_ceiling_hits", default=None)


@contextlib.contextmanager
def watch_ceiling() -> Iterator[list[str]]:
    """Collect, in the yielded list, the names of the steps the wall-clock ceiling stopped meanwhile."""
    hits: list[str] = []
    token = _hits.set(hits)
    try:
        yield hits
    finally:
        _hits.reset(token)


def record_ceiling(what: str) -> None:
    """Note that the wall-clock ceiling, not the work budget, ended ``what``."""
    hits = _hits.get()
    if hits is not None and what not in hits:
        hits.append(what)


class Work:
    """A budget of ``seconds`` of nominal work, spent by ``charge``; ``passed`` once spent or past the ceiling.

    A sub-budget (``sub``) charges its parent too and shares its ceiling, so what a step leaves unused is known
    exactly (``left_s``) without reading a clock; a side budget (``side``) charges only the outermost budget (the
    solve's: its total). Mutable: one per running step, never shared between threads.
    """

    def __init__(self, seconds: float, *, what: str = "search", parent: Work | None = None,
                 ceiling_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
                 total: Work | None = None) -> None:
        self.units = max(0.0, seconds) * UNITS_PER_S
        self.spent = 0.0
        self.what = what
        self._parent = parent
        self._total = total  # a side's: the outermost budget, charged beside its creator
        self._clock = clock
        nominal_s = max(0.0, seconds if ceiling_s is None else ceiling_s)  # the work the steps may really take
        self.ceiling_at = parent.ceiling_at if parent is not None else \
            clock() + CEILING_FACTOR * nominal_s + CEILING_SLACK_S

    @staticmethod
    def of(seconds: float, within: Work | None, what: str) -> Work:
        """``seconds`` of work inside ``within`` (its ceiling), or a budget of its own when None."""
        return within.sub(seconds, what) if within is not None else Work(seconds, what=what)

    def sub(self, seconds: float, what: str | None = None) -> Work:
        return Work(seconds, what=what or self.what, parent=self, clock=self._clock)

    def side(self, seconds: float, what: str) -> Work:
        """A budget beside this one: its own ``seconds``, this one's ceiling, charged to it and the outermost budget
        (``top``) only: the steps after it keep their work, the steps after the outermost one's current step (the
        next microbatch counts) pay for it, so the whole stays within its limit (issue 36: uncharged, the sides
        took 1.5-2x a solve's limit)."""
        side = Work(seconds, what=what, clock=self._clock, total=self.top())
        side.ceiling_at = self.ceiling_at
        return side

    def top(self) -> Work:
        """The outermost budget this one's work is charged to (itself when none)."""
        outer = self._parent or self._total
        return self if outer is None else outer.top()

    def charge(self, units: float) -> None:
        self.spent += units
        if self._parent is not None:
            self._parent.charge(units)
        elif self._total is not None:
            self._total.charge(units)

    def spent_s(self) -> float:
        return self.spent / UNITS_PER_S

    def left_s(self) -> float:
        """Nominal seconds of work left (negative once overspent)."""
        return (self.units - self.spent) / UNITS_PER_S

    def ceiling_left_s(self) -> float:
        return self.ceiling_at - self._clock()

    def spent_out(self) -> bool:
        return self.spent >= self.units

    def passed(self) -> bool:
        """Whether the step must stop: its work is spent, or (recorded) the wall-clock ceiling has passed."""
        if self.spent >= self.units:
            return True
        if self._clock() >= self.ceiling_at:
            record_ceiling(self.what)
            return True
        return False


# Estimated costs (units) of the operations the searches repeat, from their sizes: L blocks, S stages,
# M microbatches, D stage devices; fitted on CPU time at 48x8 to 1000x64 (benchmarks/solver.py's pools), each
# within about 2x (the Python-bound ones raised by half: cache misses the fit did not see). The ceiling covers
# what they miss by far.

# Measured 2026-12-06 (CPU time of the thread, load 4-5; plan_time's cases at 30 s), not refitted: the
# best-bottleneck split (``exact`` False) costs by its stages where blocks are few. DT-FM worldwide (26 blocks, 2-26
# stages; 851 calls: 0.08 ms at 2-4 stages, 1.0-2.8 ms at 5-18, 0.3-0.5 ms at 19-26 where the split fails early):
# measured / charged median 4.60, p10 0.59, p90 8.37, total 4.49 (its sequence search 1.4 s of CPU for 0.3 s
# charged); the 1000x176 pool (1000 blocks, 2-10 stages, ~1 ms): 0.06. max(this, 150 + 130 S) fitted worldwide
# (median 1.15, total 0.92) and kept its plan, but broke test_monotone_pools seed 13 (plus a host 2,135.7 ms
# against the smaller pool's 2,074.5): kept as it was.
def partition_units(num_blocks: int, num_stages: int, *, exact: bool) -> float:
    """A sequence re-partitioned (``seq_partition.sequence_placement``; its DPs grow as L^1.5) and priced."""
    return 900.0 + 2.2 * num_blocks ** 1.5 if exact else 300.0 + 0.6 * num_blocks ** 1.5


def screen_units(num_blocks: int, num_stages: int) -> float:
    """A sequence screened (``seq_partition.screen_step``)."""
    return 150.0 + 0.45 * num_blocks * max(num_stages, 1) + 3.0 * num_blocks


# A pricing runs the compiled programs (``drain_schedule``: a step per pass, message and check) after closed forms
# worked per replica. Fitted (least relative squares) on CPU time, 2026-12-06, loaded machine: the 1205 pricings
# the searches made on benchmarks/plan_time.py's cases at a 10 s limit (M 1..512, S 2..176; cache misses
# included, so not raised) and 300 random plans (M 4..512, S 2..32, half replicated, 104 verified). Predicted /
# measured, summed (median; 10th percentile): ``program_units`` 0.97 (0.96; 0.58) on the searches' pricings, 0.38
# (0.67; 0.16) on the random plans, whose replicas and verifiers it cannot see; ``placement_units`` 0.96 (1.02;
# 0.78) and 0.96 (0.87; 0.61). Before (80 + 1.5 M S): 0.40 (0.33; 0.19) and 0.16 (0.23; 0.07).

def program_units(num_microbatches: int, num_stages: int) -> float:
    """A plan's compiled programs priced (``objective.price_program``), its violations checked; its replicas and
    verifiers unknown (``placement_units`` counts them: closer where a plan has many)."""
    return 380.0 + 3.5 * num_microbatches * max(num_stages, 1)


def placement_units(placement) -> float:
    """``program_units`` of a ``objective.Placement``: its passes (M x S), replicas and checked copies (M x V)."""
    M, S = placement.num_microbatches, max(placement.num_stages, 1)
    devices = sum(len(st.devices) for st in placement.stages)
    return 60.0 + 3.0 * M * S + 22.0 * devices + 19.0 * M * len(placement.verifiers)


# A uniform grid is charged by how far ``grid._grid`` took it. Fitted 2026-12-06 (relative least squares, non-negative
# terms, rounded) on the CPU time (of the thread) of every ``_grid`` call and every closed-form pricing of
# ``cheapest``'s ranking in 10 solves under the charge before (load 1-4): plan_time's 1000x176 pool at 30 s, tiered
# 96x40 at 3 s and 48x40 at 1 s, test_one_cost pools 0/2/4 at 2 s, test_monotone_pools seeds 13/14 at 1 s, SENTINEL-
# and HexiScale-like at 5 s (100k grids, 12k pricings). Checked on 9 of them under these charges (19.6k tries, 5.3k
# checks, 9k pricings; load 5-6), measured / charged: a try (one device order: devices taken, placed, memory checked)
# median 0.88, p10 0.71, p90 1.32, total 0.96 (1000x176 1.01, small pools 1.0-1.3, HexiScale 0.75); a check
# (verifiers placed, violations: 0.1-2 ms valid, 3-8 ms where 50+ untrusted stage devices find no verifier) median
# 1.01, p10 0.70, p90 1.51, total 1.01; a whole grid median 0.87, total 0.99 (1000x176 1.03); a pricing median 0.92,
# p10 0.73, p90 1.42, total 1.05; the setup and shape ranking, per enumeration, total 1.0-1.4 (1000x176 1.31). A
# shape out of reach (more replicas than microbatches: 66k of the 77k grids the 1000x176 pool tried, ~1 us each) is
# no longer tried. Before (20 + 5 D + 0.2 L a grid, the ranking free): the 1000x176 pool charged 83 s for 3.7 s of
# CPU (0.045), the 96x40 pool 0.56, the test pools 2-3.6x under; the ranking's 1.4 s of CPU in all was free.

def grid_setup_units(num_devices: int) -> float:
    """The pool's stage devices ordered by speed (``grid._by_speed``), once per enumeration of grids."""
    return 20.0 + 2.5 * num_devices


def grid_rank_units(num_stages: int) -> float:
    """A shape ranked by its compute-only step before any grid is tried (``grid._compute_ms``: its stages' times)."""
    return 8.0 + 0.4 * num_stages


def grid_try_units(num_devices: int, num_stages: int, stage_devices: int) -> float:
    """One device order tried for a uniform grid (``grid._grid``): of the pool's ``num_devices``, ``stage_devices``
    taken and placed, its ``num_stages`` stages' memory checked; ``stage_devices`` 0: too few devices may hold
    it (refused before any is taken)."""
    if stage_devices == 0:
        return 6.0 + 0.05 * num_devices
    return 15.0 + 0.2 * num_devices + 0.1 * stage_devices + 6.0 * num_stages


def grid_check_units(num_devices: int, stage_devices: int, untrusted: int, verified_copies: int) -> float:
    """A grid that fits memory checked (``grid._checked``): verifiers placed (each of its ``untrusted`` stage
    devices' boundaries weighed against the pool's devices) and its violations listed; ``verified_copies``:
    microbatches x verifiers placed (0 where none could be)."""
    return 20.0 + 14.0 * stage_devices + 0.18 * untrusted * num_devices + 1.6 * verified_copies


# A plan compiled (``compile.compile_plan``: its programs built, ``validate`` run) and simulated (``simulate.predict``),
# as ``planner.api`` does for the solver's plan and each rival that can still beat it once the search is done: per
# stage pass (M x S) and a constant. Measured 2026-12-06 (CPU time, load 1-4): DT-FM worldwide's plans (M 512, S 8,
# 64 ranks) 0.44-0.77 s (0.53 charged), the 48x40 pool's (M 32, S 2-4) 6.6-15 ms (9.8-18 charged), worldwide-tiny's
# (M 1, S 1) 2.5-4 ms (1.6 charged).
def compile_units(num_microbatches: int, num_stages: int) -> float:
    """A plan of ``num_microbatches`` x ``num_stages`` compiled and simulated (``planner.api``'s ``compiled``)."""
    return 1500.0 + 130.0 * num_microbatches * max(num_stages, 1)


def evaluate_units(placement) -> float:
    """A ``objective.Placement`` priced by the closed form (``objective.evaluate``): per stage and device."""
    devices = sum(len(st.devices) for st in placement.stages)
    return 2.0 + 5.5 * devices + 3.0 * placement.num_stages + 0.15 * placement.num_microbatches * len(
        placement.verifiers)


# Fitted 2026-12-06 (CPU time, loaded machine) on the tabled tests (``bound.fill``; their construction and shared
# tables spread over their tests): 171 bounds, 6,838 tests of 3-96 blocks and 1-14 devices (12 planning runs at
# 2 s, random chains of 24/48/96 blocks, 58 random problems). A test costs ~0.4-0.6 ms at 3-10 blocks, 1-2 ms at
# 15-20, 10-14 ms at 48, 19-52 ms at 96 (the tracked group's devices, which this cannot see, set the spread).
# Measured / charged: median 0.66, 10th percentile 0.43, 90th 0.90 (0.98-1.04 at 3-10 and 40-96 blocks), max
# 1.33, total 0.70: charged past its median so a plan's budget holds. The per-block test before it cost 7-16x
# what 200 + 0.66 L^2 (D + 1) charged.
def fill_units(num_blocks: int, num_devices: int) -> float:
    """One feasibility test of the fill bound (``bound.fill``; tabled per stage, vectorised, its DP over blocks)."""
    return 600.0 + 0.5 * num_blocks ** 2 * (num_devices + 1)


# A DP's layers query, for each start block, class, previous class, next class and replica option, a range minimum
# found by halving its sparse tables (levels: the bit length of L); the lumped last layer (two tables a state) and
# the stage-length limits (a binary search a query, at each new cap) cost about 4 layers more; ~1 ns a step. The
# rest (tables filled, the traceback, the cutting-plane LP, the box logic) is the constant. Fitted 2026-12-06
# (benchmarks/calibrate_units.py: CPU time of the solving thread, loaded machine) on 225 bound searches (4,585 DPs)
# of 14 solves: the 1000x176 pool at 30 s, tiered 250x88 and 96x40, six random wide-area pools (test_one_cost),
# SENTINEL-, HexiScale-, DT-FM-, Sailor-like and consumer-40 pools (6-1000 blocks, 1-44 classes, 1-15 replica
# options, 1-32 layers). Per charge (the DPs of a LazyDP's call, the LP, the box logic): measured / charged median
# 0.91, p10 0.35, p90 1.72, total 1.04 (1000x176: 1.22; SENTINEL's 44 classes: 1.03; small pools 0.5-0.9).
# Before (400 + (0.006 L^1.5 C + 0.07 C^3) R J): total 2.55, 4.83 on the 1000x176 pool (3-15x on its DPs).
# Re-measured under this charge (its solves' own DPs): median 0.85, p10 0.36, p90 1.75, total 1.12; it misses
# where a search runs hundreds of tiny DPs (1 class: the LP and its pool of cuts grow with them, 3-12x).
# Whole bound searches on DT-FM worldwide at 30 s (2026-12-06, load 3-5; 1,811 charges: DPs, LPs, the relaxed
# plans priced) ran 2.5 s of CPU for 2.5 s charged (total 1.0): there the tiny DPs' overrun is made up by the rest.
def dp_units(num_blocks: int, num_classes: int, replica_choices: int, layers: int) -> float:
    """One sequence DP of the bound (``bound.sequence_dp``) and the cutting-plane LP after it."""
    steps = (layers + 4) * num_blocks * num_classes ** 3 * replica_choices * max(num_blocks, 2).bit_length()
    return 250.0 + 0.001 * steps


# The bounds a count computes once its plan is found (``solver.count_solve``), which charged nothing before (issue 36:
# 1.4 s of CPU of 19.7 planning the 1000x176 pool at 30 s). Measured 2026-12-06 (CPU time of the thread, load 1-3):
# the fluid LP 70 ms at 1000 blocks x 8 stage classes, 1.5-1.8 ms at 26 x 8, 0.5-0.9 ms at 6-24 x 4-8; the link
# bound less its fill tests (charged by ``bound.fill``) 45-61 ms at 1000 blocks, 37-43 at 26, 30 at 24, 18-19 at 6.
def program_bound_units(num_blocks: int, stage_classes: int) -> float:
    """``objective.program_lower_bound_ms``: the fluid LP over blocks x stage classes."""
    return 400.0 + 8.5 * num_blocks * max(stage_classes, 1)


def link_bound_units(num_blocks: int) -> float:
    """``bound.links.link_lower_bound`` less its fill tests: its windows, LPs and partitions."""
    return 10_000.0 + 6_000.0 * math.log(max(num_blocks, 1))


def chain_sum_units(num_blocks: int, num_stages: int) -> float:
    """One min-sum DP of the homogeneous chain partition (``chain_dp``)."""
    return 100.0 + 0.09 * num_blocks * max(num_stages, 1)
