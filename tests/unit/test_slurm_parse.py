"""Parsers against output recorded from the real local Slurm 22.05 cluster (tests/data/slurm/README.md)."""

from pathlib import Path

import pytest

from pearlctl.slurm.parse import (
    ParseError,
    expand_nodelist,
    expand_ranges,
    parse_gres_count,
    parse_gres_indices,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_jobs,
    parse_sinfo,
    parse_squeue_json,
)
from pearlctl.slurm.records import STATE_TABLE, JobPhase, phase_of

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


def by_key(records):
    return {r.key: r for r in records}


def test_small_shapes():
    assert parse_sbatch_parsable(read("sbatch_parsable.txt")) == "1"
    assert parse_sbatch_parsable("123;cluster\n") == "123"
    with pytest.raises(ParseError):
        parse_sbatch_parsable("sbatch: error: Batch job submission failed")
    assert expand_ranges("0-3,7,9-10%2") == [0, 1, 2, 3, 7, 9, 10]
    assert expand_ranges("[4-5]") == [4, 5] and expand_ranges("0-6:3") == [0, 3, 6]
    assert expand_nodelist("gpu[1-3,5],cpu7") == ["gpu1", "gpu2", "gpu3", "gpu5", "cpu7"]
    assert expand_nodelist("n[08-10]") == ["n08", "n09", "n10"]
    assert expand_nodelist("(null)") == []
    assert parse_gres_indices("gpu:8(IDX:0-7)") == tuple(range(8))
    assert parse_gres_indices("gpu:a100:2(IDX:0,2)") == (0, 2)
    assert parse_gres_indices("gpu(IDX:N/A)") == ()
    assert parse_gres_count("gpu:8") == 8 and parse_gres_count("gpu:a100:4(S:0-1)") == 4
    assert parse_gres_count("(null)") == 0


def test_squeue_json_running_tasks_and_pending_range():
    recs = parse_squeue_json(read("squeue_array_pending_running.json"))
    pool = [r for r in recs if r.name == "pool"]
    running = {r.array_task_id: r for r in pool if r.phase is JobPhase.RUNNING}
    assert sorted(running) == [0, 1, 2, 3]
    assert {r.job_id for r in pool} == {"1"}
    assert running[0].nodes == ("gpu1",) and running[0].gpus == {"gpu1": tuple(range(8))}
    pending = [r for r in pool if r.phase is JobPhase.PENDING]
    assert len(pending) == 1 and pending[0].array_task_id is None
    assert pending[0].pending_tasks == (4, 5) and pending[0].reason == "Resources"
    plain = [r for r in recs if r.name == "plain"][0]
    assert plain.array_task_id is None and plain.job_id == "2"


def test_squeue_json_shows_preemption_then_requeue_then_rerun():
    during = by_key(parse_squeue_json(read("squeue_preempting.json")))
    t0 = during[("1", 0)]
    assert t0.state == "RUNNING" and t0.preempt_time is not None and t0.preempt_time >= t0.start_time
    assert during[("1", 1)].preempt_time is None
    # the array's first job id is reused by its last task: still keyed by (array id, task)
    assert during[("1", 3)].nodes == ("gpu4",)
    requeued = by_key(parse_squeue_json(read("squeue_requeued_pending.json")))[("1", 0)]
    assert requeued.phase is JobPhase.PENDING and requeued.restarts == 1 and requeued.preempt_time is None
    assert requeued.reason == "BeginTime"
    rerun = by_key(parse_squeue_json(read("squeue_rerunning.json")))[("1", 0)]
    assert rerun.phase is JobPhase.RUNNING and rerun.restarts == 1 and rerun.nodes == ("gpu1",)


def test_squeue_json_from_a_stalled_slurmctld_is_an_error_not_an_empty_queue():
    """Recorded with slurmctld SIGSTOPped: squeue exits 0 with no jobs and an error. Read as an empty queue,
    every job of a run looked gone, and without accounting the watcher would have marked them LOST."""
    text = (DATA / "squeue_json_slurmctld_stopped.json").read_text()
    with pytest.raises(ParseError, match="Failed while looking for jobs"):
        parse_squeue_json(text)


def test_squeue_json_rejects_garbage():
    with pytest.raises(ParseError):
        parse_squeue_json("not json")
    with pytest.raises(ParseError):
        parse_squeue_json('{"errors": []}')


def test_scontrol_one_liners_with_per_node_gres():
    recs = by_key(parse_scontrol_jobs(read("scontrol_preempting.txt")))
    t0 = recs[("1", 0)]
    assert t0.state == "RUNNING" and t0.partition == "preempt" and t0.name == "elastic"
    assert t0.gpus == {"gpu1": tuple(range(8))} and t0.restarts == 0 and t0.preempt_time is not None
    requeued = by_key(parse_scontrol_jobs(read("scontrol_requeued.txt")))[("1", 0)]
    assert requeued.phase is JobPhase.PENDING and requeued.restarts == 1


def test_scontrol_keeps_finished_jobs_with_final_states():
    recs = parse_scontrol_jobs(read("scontrol_finished.txt"))
    phases = {r.phase for r in recs}
    assert JobPhase.ENDED in phases
    assert {r.state for r in recs} & {"COMPLETED", "CANCELLED", "FAILED"}


def test_sacct_final_states_and_duplicates():
    recs = by_key(parse_sacct(read("sacct_array.txt")))
    assert recs[("6", 0)].state == "COMPLETED" and recs[("6", 0)].phase is JobPhase.ENDED
    assert recs[("10", None)].state == "FAILED" and recs[("10", None)].exit_code == "3:0"
    assert phase_of(recs[("9", None)].state) is JobPhase.ENDED  # "CANCELLED by 0"
    # with --duplicates the preempted first run shows up, and the last line for a task wins
    dup = by_key(parse_sacct(read("sacct_array_duplicates.txt")))
    assert dup[("1", 0)].state.startswith("CANCELLED")
    assert "PREEMPTED" in read("sacct_array_duplicates.txt")


def test_sinfo_partitions():
    parts = parse_sinfo(read("sinfo_pearl_format.txt"))
    assert set(parts) == {"debug", "preempt", "high"}
    assert parts["debug"].default and parts["debug"].nodes == 4 and parts["debug"].max_gpus_per_node == 8
    with pytest.raises(ParseError):
        parse_sinfo("debug up 4")


def test_state_table_maps_every_known_state_and_unknown_is_unknown():
    for name, (phase, why) in STATE_TABLE.items():
        assert phase_of(name) is phase and why
    assert phase_of("COMPLETING+") is JobPhase.RUNNING
    assert phase_of("SOMETHING_NEW") is JobPhase.UNKNOWN
    assert phase_of("") is JobPhase.UNKNOWN
