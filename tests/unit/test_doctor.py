"""`pearlctl doctor`'s Slurm checks on a recorded runner (the command-runner seam): the settings preemption
handling needs, read from `scontrol show config` and `scontrol show partition -o`, and a machine where Slurm
is installed but finds no configuration."""

from __future__ import annotations

from pathlib import Path

from pearlctl.ops.doctor import FAIL, OK, WARN, check_slurm
from pearlctl.slurm.client import SlurmClient
from pearlctl.slurm.parse import parse_scontrol_config, parse_scontrol_partitions
from pearlctl.slurm.runner import CommandResult

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"
PARTITIONS = (DATA / "scontrol_show_partition_o.txt").read_text()  # debug 0 s OFF, preempt 10 s REQUEUE, high 0 s OFF

# An excerpt of `scontrol show config` in 22.05's shape (scontrol_show_config.txt is a whole one), the
# preemption settings filled in per test
CONFIG = """Configuration data as of 2026-11-30T08:20:01
AccountingStorageBackupHost = (null)
ClusterName             = pearl
KillWait                = 5 sec
MinJobAge               = 600 sec
PreemptMode             = {mode}
PreemptType             = {ptype}
PreemptExemptTime       = 00:00:00
SchedulerParameters     = sched_interval=1,bf_interval=1
SlurmctldParameters     = {params}
SlurmctldPort           = 6817

Cgroup Support Configuration:
AllowedKmemSpace        = (null)

Slurmctld(primary) at 127.0.0.1 is UP
"""

NO_CONFIG = (
    "scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
    "scontrol: error: fetch_config: DNS SRV lookup failed\n"
    "scontrol: error: _establish_config_source: failed to fetch config\n"
    "scontrol: fatal: Could not establish a configuration source\n"
)


class Recorded:
    """Answers each argv with a recorded result; records what ran."""

    def __init__(self, answers: dict[tuple[str, ...], CommandResult]):
        self.answers = answers
        self.ran: list[tuple[str, ...]] = []

    def run(self, argv, *, timeout, input=None):
        self.ran.append(tuple(argv))
        return self.answers[tuple(argv)]


def ok(argv: tuple[str, ...], stdout: str) -> tuple[tuple[str, ...], CommandResult]:
    return argv, CommandResult(argv, 0, stdout, "")


def cluster(
    *, params="preempt_send_user_signal", mode="REQUEUE", ptype="preempt/partition_prio", partitions=PARTITIONS
):
    return Recorded(
        dict(
            [
                ok(("scontrol", "--version"), "slurm-wlm 22.05.8\n"),
                ok(("scontrol", "ping"), "Slurmctld(primary) at 127.0.0.1 is UP\n"),
                ok(("sinfo", "-h", "-o", "%P|%a|%D|%G|%l"), "debug*|up|4|gpu:8|infinite\n"),
                ok(("sacct", "-n", "-X", "-j", "1"), ""),
                ok(("scontrol", "show", "config"), CONFIG.format(params=params, mode=mode, ptype=ptype)),
                ok(("scontrol", "show", "partition", "-o"), partitions),
            ]
        )
    )


def checks_of(runner, env=None) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.detail) for c in check_slurm(SlurmClient(runner), env={} if env is None else env)}


def test_recorded_scontrol_show_config_parses_the_settings_doctor_reads():
    config = parse_scontrol_config((DATA / "scontrol_show_config.txt").read_text())
    assert config["PreemptMode"] == "REQUEUE"
    assert config["PreemptType"] == "preempt/partition_prio"
    assert config["SlurmctldParameters"] == "preempt_send_user_signal"
    assert config["ClusterName"] == "pearl" and config["KillWait"] == "5 sec"
    parts = parse_scontrol_partitions(PARTITIONS)
    assert [(p.name, p.preempt_mode, p.grace_time_s) for p in parts] == [
        ("debug", "OFF", 0),
        ("preempt", "REQUEUE", 10),
        ("high", "OFF", 0),
    ]


def test_every_preemption_setting_present_is_ok_and_reports_each_partitions_grace_time():
    runner = cluster()
    checks = checks_of(runner)
    assert ("scontrol", "show", "config") in runner.ran and ("scontrol", "show", "partition", "-o") in runner.ran
    assert checks["preempt signal"] == (OK, "SlurmctldParameters=preempt_send_user_signal")
    assert checks["preempt type"] == (OK, "PreemptType=preempt/partition_prio")
    status, detail = checks["preempt mode"]
    assert status == OK
    assert detail == (
        "PreemptMode=REQUEUE cluster-wide; partitions that override it: debug (OFF), high (OFF) "
        "(preemptible pools do not belong there)"
    )
    status, detail = checks["grace time"]
    assert status == OK
    assert detail.startswith("GraceTime: debug 0 s, preempt 10 s, high 0 s; ")
    assert "a pool's preempt_notice_s (default 60) must not exceed its partition's GraceTime" in detail


def test_preempt_send_user_signal_among_other_parameters_is_found():
    checks = checks_of(cluster(params="enable_configless,preempt_send_user_signal,idle_on_node_suspend"))
    assert checks["preempt signal"][0] == OK


def test_missing_preempt_send_user_signal_warns_with_the_slurm_conf_line():
    status, detail = checks_of(cluster(params="(null)"))["preempt signal"]
    assert status == WARN
    assert "SlurmctldParameters=(null) lacks preempt_send_user_signal" in detail
    assert "`SlurmctldParameters=preempt_send_user_signal`" in detail
    # a parameter that merely contains the word is not it
    assert checks_of(cluster(params="no_preempt_send_user_signal_x"))["preempt signal"][0] == WARN


def test_preempt_mode_off_warns_with_the_slurm_conf_line_and_names_partitions_that_requeue():
    status, detail = checks_of(cluster(mode="OFF"))["preempt mode"]
    assert status == WARN
    assert detail == (
        "PreemptMode=OFF cluster-wide: a preempted job is not requeued unless its partition overrides it "
        "(PreemptMode=REQUEUE on preempt); add the slurm.conf line `PreemptMode=REQUEUE`"
    )
    no_requeue = PARTITIONS.replace("PreemptMode=REQUEUE", "PreemptMode=CANCEL")
    status, detail = checks_of(cluster(mode="CANCEL", partitions=no_requeue))["preempt mode"]
    assert status == WARN
    assert detail == (
        "PreemptMode=CANCEL cluster-wide: a preempted job is not requeued; "
        "add the slurm.conf line `PreemptMode=REQUEUE`"
    )
    assert checks_of(cluster(mode="GANG,REQUEUE"))["preempt mode"][0] == OK


def test_preempt_type_none_warns_with_the_slurm_conf_line():
    status, detail = checks_of(cluster(ptype="preempt/none"))["preempt type"]
    assert status == WARN
    assert "PreemptType=preempt/none: Slurm never preempts a job" in detail
    assert "`PreemptType=preempt/partition_prio`" in detail
    assert checks_of(cluster(ptype="preempt/qos"))["preempt type"] == (OK, "PreemptType=preempt/qos")


def test_no_partition_with_grace_time_warns_with_the_slurm_conf_line():
    status, detail = checks_of(cluster(partitions=PARTITIONS.replace("GraceTime=10", "GraceTime=0")))["grace time"]
    assert status == WARN
    assert detail.startswith("GraceTime: debug 0 s, preempt 0 s, high 0 s: a preempted job is killed at once")
    assert "`GraceTime=60`" in detail and "`PartitionName=...` line" in detail


def test_missing_settings_only_warn_never_fail():
    checks = checks_of(cluster(params="(null)", mode="OFF", ptype="preempt/none"))
    assert not [name for name, (status, _) in checks.items() if status == FAIL]


def test_no_slurm_configuration_says_so_and_how_to_point_at_one_instead_of_scontrols_errors():
    argv = ("scontrol", "--version")
    runner = Recorded({argv: CommandResult(argv, 1, "", NO_CONFIG)})
    checks = check_slurm(SlurmClient(runner), env={})
    assert [(c.name, c.status) for c in checks] == [("slurm config", WARN)]
    detail = checks[0].detail
    assert detail.startswith("Slurm is installed but no Slurm configuration was found (SLURM_CONF is not set;")
    assert "`export SLURM_CONF=/path/to/slurm.conf`" in detail
    assert '`eval "$(python3 scripts/localslurm.py up | tail -n 1)"`' in detail
    assert "DNS SRV" not in detail.replace("no DNS SRV record", "") and "fatal" not in detail
    assert runner.ran == [argv]  # nothing more is asked of a Slurm with no configuration


def test_slurm_conf_naming_no_file_fails_without_running_slurm(tmp_path):
    runner = Recorded({})
    checks = check_slurm(SlurmClient(runner), env={"SLURM_CONF": str(tmp_path / "nope.conf")})
    assert [(c.name, c.status) for c in checks] == [("slurm config", FAIL)]
    assert checks[0].detail.startswith(f"SLURM_CONF={tmp_path / 'nope.conf'} names no file")
    assert runner.ran == []  # scontrol would retry for 60 s before saying so


def test_other_scheduler_errors_still_fail_with_what_slurm_said():
    argv = ("scontrol", "--version")
    runner = Recorded({argv: CommandResult(argv, 1, "", "scontrol: error: Invalid user for SlurmUser slurm")})
    checks = check_slurm(SlurmClient(runner), env={})
    assert [(c.name, c.status) for c in checks] == [("slurmctld", FAIL)]
    assert "Invalid user for SlurmUser slurm" in checks[0].detail
