"""Pipeline schedules as data (jax-free).

A schedule is a tuple of clock ticks; each tick is a tuple of :class:`Task` s that run at
the same time, at most one per pipeline stage.  A task is the forward or the backward pass
of one microbatch on one stage (and, for interleaved schedules, on one model chunk of that
stage).  The optimizer update after the last backward is not part of a schedule.

Builders:

* :func:`gpipe` -- all forwards, then all backwards; every stage holds all microbatches.
* :func:`one_f_one_b` -- PipeDream-flush / Megatron 1F1B: stage ``i`` (0-based) runs
  ``min(S - i, B)`` forwards before its first backward, then alternates, so at most
  ``S - i`` microbatches are ever in flight on it.
* :func:`interleaved_one_f_one_b` -- Megatron's interleaved 1F1B with ``v`` model chunks per
  stage (virtual stage ``chunk * S + stage``); a tick is one chunk's worth of work.

GPipe and 1F1B take exactly ``2 (S + B - 1)`` ticks; interleaved 1F1B takes
``2 (v B + S - 1)`` chunk-sized ticks, i.e. its bubble is ``v`` times smaller.

Guarantees: every builder's output passes :func:`validate` (each forward and backward runs
exactly once, after what it depends on).  Builders lay each stage's tasks out in its
program order and let every task start at the first tick its inputs are ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class Task:
    """Forward or backward of ``microbatch`` on pipeline ``stage`` (model ``chunk``)."""

    stage: int
    microbatch: int
    kind: str
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"task kind must be {FORWARD!r} or {BACKWARD!r}, got {self.kind!r}")

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind[0].upper()}{self.microbatch}@s{self.stage}{chunk}"


Schedule = tuple[tuple[Task, ...], ...]


class ScheduleError(ValueError):
    """A schedule breaks a dependency, repeats or misses a task, or overbooks a stage."""


def _check_sizes(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _virtual_stage(task: Task, num_stages: int) -> int:
    return task.chunk * num_stages + task.stage


def _dependencies(task: Task, num_stages: int, num_chunks: int) -> list[Task]:
    """The tasks that must finish in an earlier tick before ``task`` may run."""
    virtual = _virtual_stage(task, num_stages)
    last = num_stages * num_chunks - 1

    def at(v: int, kind: str) -> Task:
        return Task(v % num_stages, task.microbatch, kind, v // num_stages)

    if task.kind == FORWARD:
        return [at(virtual - 1, FORWARD)] if virtual > 0 else []
    deps = [at(virtual, FORWARD)]
    if virtual < last:
        deps.append(at(virtual + 1, BACKWARD))
    return deps


def _list_schedule(orders: Sequence[Sequence[Task]], num_stages: int, num_chunks: int) -> Schedule:
    """Run each stage's tasks in order, each at the first tick its dependencies are done."""
    position = [0] * len(orders)
    done: set[Task] = set()
    ticks: list[tuple[Task, ...]] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        tick = []
        for stage, order in enumerate(orders):
            if position[stage] < len(order):
                task = order[position[stage]]
                if all(dep in done for dep in _dependencies(task, num_stages, num_chunks)):
                    tick.append(task)
        if not tick:  # only reachable through a wrong program order: a bug, not bad input
            raise RuntimeError("pipeline program orders deadlock")
        for task in tick:
            position[task.stage] += 1
        done.update(tick)
        remaining -= len(tick)
        ticks.append(tuple(tick))
    return tuple(ticks)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (in microbatch order)."""
    _check_sizes(num_stages, num_microbatches)
    orders = [
        [Task(s, m, FORWARD) for m in range(num_microbatches)]
        + [Task(s, m, BACKWARD) for m in range(num_microbatches)]
        for s in range(num_stages)
    ]
    return _list_schedule(orders, num_stages, 1)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady forward/backward pairs, cool-down.

    Stage ``i`` runs ``min(S - i - 1, B)`` warm-up forwards, then ``forward, backward``
    pairs, then the remaining backwards: at most ``S - i`` microbatches are in flight.
    """
    _check_sizes(num_stages, num_microbatches)
    orders = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        order = [Task(s, m, FORWARD) for m in range(warmup)]
        for k in range(num_microbatches - warmup):
            order += [Task(s, warmup + k, FORWARD), Task(s, k, BACKWARD)]
        order += [Task(s, m, BACKWARD) for m in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return _list_schedule(orders, num_stages, 1)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: ``num_chunks`` model chunks per stage.

    Model chunk ``c`` of stage ``s`` is virtual stage ``c * S + s``.  Microbatches go
    through the chunks in groups of ``S``, so ``num_microbatches`` must be a multiple of
    ``num_stages`` (as in Megatron-LM).  Stage ``s`` runs ``2 (S - s - 1) + (v - 1) S``
    warm-up forwards; its peak in-flight count (microbatch-chunks) is one more than that.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    if num_microbatches % num_stages:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"num_stages ({num_stages}); try {num_stages * -(-num_microbatches // num_stages)}"
        )
    group = num_stages * num_chunks
    total = num_microbatches * num_chunks

    def task(stage: int, k: int, kind: str) -> Task:
        chunk = (k % group) // num_stages
        if kind == BACKWARD:
            chunk = num_chunks - 1 - chunk
        microbatch = (k // group) * num_stages + k % num_stages
        return Task(stage, microbatch, kind, chunk)

    orders = []
    for s in range(num_stages):
        warmup = min(2 * (num_stages - s - 1) + (num_chunks - 1) * num_stages, total)
        order = [task(s, k, FORWARD) for k in range(warmup)]
        for k in range(total - warmup):
            order += [task(s, warmup + k, FORWARD), task(s, k, BACKWARD)]
        order += [task(s, k, BACKWARD) for k in range(total - warmup, total)]
        orders.append(order)
    return _list_schedule(orders, num_stages, num_chunks)


def validate(
    schedule: Schedule, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a complete, legal schedule.

    Legal: tasks name existing stages/chunks/microbatches; no stage runs two tasks in one
    tick; every forward and backward of every (stage, chunk, microbatch) appears exactly
    once; a forward runs after the previous virtual stage's forward of that microbatch, a
    backward after its own forward and after the next virtual stage's backward.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    when: dict[Task, int] = {}
    for t, tick in enumerate(schedule):
        busy: set[int] = set()
        for task in tick:
            if not (
                0 <= task.stage < num_stages
                and 0 <= task.microbatch < num_microbatches
                and 0 <= task.chunk < num_chunks
            ):
                raise ScheduleError(
                    f"tick {t}: task {task} is outside {num_stages} stages x "
                    f"{num_microbatches} microbatches x {num_chunks} chunks"
                )
            if task.stage in busy:
                raise ScheduleError(f"tick {t}: stage {task.stage} runs more than one task")
            busy.add(task.stage)
            if task in when:
                raise ScheduleError(f"task {task} runs twice (ticks {when[task]} and {t})")
            when[task] = t
    expected = num_stages * num_chunks * num_microbatches * 2
    if len(when) != expected:
        missing = [
            Task(s, m, kind, c)
            for s in range(num_stages)
            for c in range(num_chunks)
            for m in range(num_microbatches)
            for kind in (FORWARD, BACKWARD)
            if Task(s, m, kind, c) not in when
        ]
        raise ScheduleError(
            f"{len(missing)} task(s) never run, e.g. {', '.join(map(str, missing[:4]))}"
        )
    for task, t in when.items():
        for dep in _dependencies(task, num_stages, num_chunks):
            if when[dep] >= t:
                raise ScheduleError(
                    f"{task} runs at tick {t} but depends on {dep}, which runs at tick {when[dep]}"
                )


def in_flight_peak(schedule: Schedule, stage: int) -> int:
    """Most microbatch(-chunk)s whose forward is done and backward not yet, on ``stage``.

    Counted at the end of each tick; this is what sets a stage's activation memory.
    """
    in_flight = peak = 0
    for tick in schedule:
        for task in tick:
            if task.stage == stage:
                in_flight += 1 if task.kind == FORWARD else -1
        peak = max(peak, in_flight)
    return peak


def bubble_fraction(schedule: Schedule, num_stages: int) -> float:
    """Fraction of stage-ticks left idle: ``1 - tasks / (num_stages * ticks)``.

    For GPipe and 1F1B this is ``(S - 1) / (B + S - 1)``; Megatron's "bubble fraction"
    ``(S - 1) / B`` is the same idle time divided by busy time instead of total time.
    """
    if not schedule:
        raise ValueError("empty schedule has no bubble fraction")
    tasks = sum(len(tick) for tick in schedule)
    return 1.0 - tasks / (num_stages * len(schedule))


def _stage_times(schedule: Schedule, times: Sequence[float], name: str) -> tuple[int, int]:
    num_stages = 1 + max(task.stage for tick in schedule for task in tick)
    num_chunks = 1 + max(task.chunk for tick in schedule for task in tick)
    if len(times) != num_stages * num_chunks:
        raise ValueError(
            f"{name} has {len(times)} entries; the schedule has {num_stages} stages x "
            f"{num_chunks} chunks = {num_stages * num_chunks} virtual stages"
        )
    return num_stages, num_chunks


def schedule_latency(
    stage_fwd_times: Sequence[float], stage_bwd_times: Sequence[float], schedule: Schedule
) -> float:
    """Step time under a clocked model: each tick lasts as long as its slowest task.

    Times are per virtual stage (``chunk * S + stage``; just per stage without chunks).
    The clocked model is pessimistic when stages are unequal: a fast stage waits for the
    slow one at every tick.  :func:`async_schedule_latency` removes that barrier.
    """
    num_stages, _ = _stage_times(schedule, stage_fwd_times, "stage_fwd_times")
    _stage_times(schedule, stage_bwd_times, "stage_bwd_times")
    total = 0.0
    for tick in schedule:
        total += max(
            (stage_fwd_times if t.kind == FORWARD else stage_bwd_times)[
                _virtual_stage(t, num_stages)
            ]
            for t in tick
        )
    return total


def async_schedule_latency(
    stage_fwd_times: Sequence[float], stage_bwd_times: Sequence[float], schedule: Schedule
) -> float:
    """Step time when each stage runs its tasks in schedule order with no global clock.

    A task starts once its stage is free and its dependencies have finished.  Never more
    than :func:`schedule_latency`; equal to it when every task takes the same time.  For
    GPipe and 1F1B with identical stages it is Alpa's ``sum(t) + (B - 1) max(t)``.
    """
    num_stages, num_chunks = _stage_times(schedule, stage_fwd_times, "stage_fwd_times")
    _stage_times(schedule, stage_bwd_times, "stage_bwd_times")
    finish: dict[Task, float] = {}
    stage_free = [0.0] * num_stages
    for tick in schedule:
        for t in tick:
            deps = _dependencies(t, num_stages, num_chunks)
            start = max([stage_free[t.stage]] + [finish[d] for d in deps])
            times = stage_fwd_times if t.kind == FORWARD else stage_bwd_times
            finish[t] = start + times[_virtual_stage(t, num_stages)]
            stage_free[t.stage] = finish[t]
    return max(stage_free)
