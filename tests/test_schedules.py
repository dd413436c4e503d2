"""Pipeline schedules: completeness, dependency order, tick counts, in-flight bounds."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.inter.schedules import (
    BACKWARD,
    FORWARD,
    ScheduleError,
    Task,
    async_schedule_latency,
    bubble_fraction,
    gpipe,
    in_flight_peak,
    interleaved_one_f_one_b,
    one_f_one_b,
    schedule_latency,
    validate,
)
from autoshard.inter.stages import pipeline_objective

BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}
stages_st = st.integers(2, 16)
microbatches_st = st.integers(1, 64)


def _tick_of(schedule):
    return {task: t for t, tick in enumerate(schedule) for task in tick}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(BUILDERS)), stages=stages_st, microbatches=microbatches_st)
def test_schedule_is_complete_ordered_and_takes_the_formula_ticks(name, stages, microbatches):
    schedule = BUILDERS[name](stages, microbatches)
    assert len(schedule) == 2 * (stages + microbatches - 1)
    counts = Counter(task for tick in schedule for task in tick)
    expected = {
        Task(s, m, kind)
        for s in range(stages)
        for m in range(microbatches)
        for kind in (FORWARD, BACKWARD)
    }
    assert set(counts) == expected
    assert set(counts.values()) == {1}
    for tick in schedule:
        assert len({task.stage for task in tick}) == len(tick)
    when = _tick_of(schedule)
    for s in range(stages):
        for m in range(microbatches):
            fwd, bwd = when[Task(s, m, FORWARD)], when[Task(s, m, BACKWARD)]
            assert fwd < bwd
            if s > 0:
                assert when[Task(s - 1, m, FORWARD)] < fwd
            if s < stages - 1:
                assert when[Task(s + 1, m, BACKWARD)] < bwd
    validate(schedule, stages, microbatches)


@settings(max_examples=60, deadline=None)
@given(stages=stages_st, microbatches=microbatches_st)
def test_one_f_one_b_in_flight_bound_and_gpipe_holds_everything(stages, microbatches):
    fb = one_f_one_b(stages, microbatches)
    gp = gpipe(stages, microbatches)
    for s in range(stages):
        assert in_flight_peak(fb, s) <= stages - s
        assert in_flight_peak(fb, s) == min(stages - s, microbatches)
        assert in_flight_peak(gp, s) == microbatches


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(2, 8), groups=st.integers(1, 6), chunks=st.integers(1, 4))
def test_interleaved_is_valid_and_shrinks_the_bubble(stages, groups, chunks):
    microbatches = stages * groups
    schedule = interleaved_one_f_one_b(stages, microbatches, chunks)
    validate(schedule, stages, microbatches, chunks)
    assert len(schedule) == 2 * (chunks * microbatches + stages - 1)
    total = chunks * microbatches
    for s in range(stages):
        warmup = 2 * (stages - s - 1) + (chunks - 1) * stages
        assert in_flight_peak(schedule, s) == min(warmup + 1, total)
    plain = one_f_one_b(stages, microbatches)
    if chunks > 1:
        assert bubble_fraction(schedule, stages) < bubble_fraction(plain, stages)


def test_interleaved_rejects_microbatches_not_multiple_of_stages():
    with pytest.raises(ValueError, match="multiple of num_stages"):
        interleaved_one_f_one_b(4, 6, 2)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (4, 8), (8, 3)])
def test_bubble_fraction_matches_formula(name, stages, microbatches):
    schedule = BUILDERS[name](stages, microbatches)
    assert bubble_fraction(schedule, stages) == pytest.approx(
        (stages - 1) / (microbatches + stages - 1)
    )


def _without(schedule, victim):
    return tuple(tuple(t for t in tick if t != victim) for tick in schedule)


def test_validate_catches_missing_duplicate_overbooked_and_out_of_order():
    schedule = one_f_one_b(3, 4)
    validate(schedule, 3, 4)
    victim = Task(1, 2, BACKWARD)
    with pytest.raises(ScheduleError, match="never run"):
        validate(_without(schedule, victim), 3, 4)
    with pytest.raises(ScheduleError, match="twice|more than one"):
        validate(schedule + ((victim,),), 3, 4)
    # two tasks of stage 0 in the first tick
    crowded = ((Task(0, 0, FORWARD), Task(0, 1, FORWARD)),) + _without(
        schedule, Task(0, 1, FORWARD)
    )
    with pytest.raises(ScheduleError, match="more than one"):
        validate(crowded, 3, 4)
    # stage 2's forward of microbatch 0 moved to the very first tick, before stage 1's
    early = ((Task(2, 0, FORWARD),),) + _without(schedule, Task(2, 0, FORWARD))
    with pytest.raises(ScheduleError, match="depends on"):
        validate(early, 3, 4)
    with pytest.raises(ScheduleError, match="outside"):
        validate(schedule + ((Task(5, 0, FORWARD),),), 3, 4)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(BUILDERS)),
    stages=st.integers(2, 6),
    microbatches=st.integers(1, 12),
    data=st.data(),
)
def test_async_latency_never_exceeds_clocked_and_equal_times_match_alpa(
    name, stages, microbatches, data
):
    schedule = BUILDERS[name](stages, microbatches)
    times = st.lists(st.floats(0.1, 10.0), min_size=stages, max_size=stages)
    fwd, bwd = data.draw(times), data.draw(times)
    assert async_schedule_latency(fwd, bwd, schedule) <= schedule_latency(fwd, bwd, schedule) + 1e-9
    # equal stages: the async model gives Alpa's objective; with f == b so does the clocked one
    f, b = data.draw(st.floats(0.1, 5.0)), data.draw(st.floats(0.1, 5.0))
    asynchronous = async_schedule_latency([f] * stages, [b] * stages, schedule)
    assert asynchronous == pytest.approx(pipeline_objective([f + b] * stages, microbatches))
    clocked = schedule_latency([f] * stages, [f] * stages, schedule)
    assert clocked == pytest.approx(pipeline_objective([2 * f] * stages, microbatches))


def test_latency_rejects_wrong_number_of_times():
    with pytest.raises(ValueError, match="virtual stages"):
        schedule_latency([1.0, 1.0], [1.0, 1.0], one_f_one_b(3, 2))
