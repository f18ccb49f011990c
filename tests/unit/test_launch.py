"""The launcher's pure parts: hostfiles in both syntaxes, -H lists, slots, command lines."""

import io
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain.cluster import hostfiles as H
from ringtrain.cluster import jobs as J
from ringtrain.cluster import launch as L
from ringtrain.errors import UsageError
from ringtrain.cluster.hostfiles import Host, check_slots, format_hostfile, parse_host_list, parse_hostfile
from ringtrain.cluster.launch import format_command, launch_command
from ringtrain.cluster.rank_log import rank_from_env

MPIRUN = "/opt/mpi/bin/mpirun"


# --- hostfiles ----------------------------------------------------------------

def test_openmpi_syntax_with_comments_and_blank_lines():
    text = "# cluster\n\nnode1 slots=2\nnode2 slots=4 max_slots=8   # big one\n  node3\n"
    assert parse_hostfile(text) == [Host("node1", 2), Host("node2", 4), Host("node3", 1)]


def test_mpich_syntax_with_comments_and_blank_lines():
    text = "node1:2\n# comment line\n   \nnode2:4 # trailing\n10.0.0.7\n"
    assert parse_hostfile(text) == [Host("node1", 2), Host("node2", 4), Host("10.0.0.7", 1)]


def test_syntaxes_may_be_mixed_and_max_slots_may_be_spelt_with_a_dash():
    assert parse_hostfile("a:3\nb slots=2 max-slots=2\n") == [Host("a", 3), Host("b", 2)]


def test_a_host_listed_twice_stays_twice():
    assert parse_hostfile("a:1\na:2\n") == [Host("a", 1), Host("a", 2)]


@pytest.mark.parametrize("text, line, got", [
    ("node0:1\n\nnode1 slots=x\n", 3, "node1 slots=x"),
    ("node1 slot=2\n", 1, "node1 slot=2"),
    ("node1:two\n", 1, "node1:two"),
    ("node1:2:3\n", 1, "node1:2:3"),
    ("a:1\nnode1 2\n", 2, "node1 2"),
    ("-np:2\n", 1, "-np:2"),
    ("node1 slots=\n", 1, "node1 slots="),
])
def test_a_bad_line_names_its_number_and_the_expected_format(text, line, got):
    with pytest.raises(UsageError) as err:
        parse_hostfile(text)
    assert str(err.value) == f"hostfile line {line}: expected 'host slots=N' or 'host:N', got {got!r}"


@pytest.mark.parametrize("text, message", [
    ("a:1\nnode1 slots=0\n", "hostfile line 2: slots must be at least 1, got 'node1 slots=0'"),
    ("node1:0\n", "hostfile line 1: slots must be at least 1, got 'node1:0'"),
    ("a slots=4 max_slots=2\n", "hostfile line 1: max_slots is less than slots in 'a slots=4 max_slots=2'"),
    ("a slots=1 slots=2\n", "hostfile line 1: slots given twice in 'a slots=1 slots=2'"),
])
def test_slot_counts_are_checked(text, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(") + "$"):
        parse_hostfile(text)


def test_a_file_with_only_comments_lists_no_hosts():
    with pytest.raises(UsageError, match="lists no hosts"):
        parse_hostfile("# nothing here\n\n")


def test_reading_a_missing_hostfile_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read hostfile"):
        H.read_hostfile(str(tmp_path / "nope"))


@pytest.mark.parametrize("flavour, text", [
    ("openmpi", "node1 slots=2\nnode2 slots=1\n"),
    ("mpich", "node1:2\nnode2:1\n"),
])
def test_written_in_the_syntax_of_each_flavour_with_slots_explicit(flavour, text):
    assert format_hostfile([Host("node1", 2), Host("node2", 1)], flavour) == text


# --- -H lists and slots ---------------------------------------------------------

def test_host_list():
    assert parse_host_list("host1:2,host2:2,host3") == [Host("host1", 2), Host("host2", 2), Host("host3", 1)]


@pytest.mark.parametrize("text, entry", [("a:2,,b:1", 2), ("a:x", 1), ("a:0", 1), ("a b", 1), ("", 1)])
def test_a_bad_host_list_entry_is_named(text, entry):
    with pytest.raises(UsageError, match=f"^-H entry {entry}: "):
        parse_host_list(text)


def test_total_slots_must_cover_np():
    check_slots([Host("a", 2), Host("b", 2)], 4)
    with pytest.raises(UsageError, match=r"^-np 5 needs 5 slots but the hosts give 4 \(a:2, b:2\); add slots"):
        check_slots([Host("a", 2), Host("b", 2)], 5)


# --- command lines --------------------------------------------------------------

def test_mpich_on_one_host():
    args, env = launch_command(3, ["python", "x.py"], mpirun=MPIRUN, flavour="mpich")
    assert args == [MPIRUN, "-np", "3", "python", "x.py"] and env == {}


def test_mpich_with_a_hostfile_and_with_hosts():
    args, _ = launch_command(4, ["prog"], mpirun=MPIRUN, flavour="mpich", hostfile="/tmp/h")
    assert args == [MPIRUN, "-f", "/tmp/h", "-np", "4", "prog"]
    args, _ = launch_command(4, ["prog"], mpirun=MPIRUN, flavour="mpich", hosts=[Host("a", 2), Host("b", 2)])
    assert args == [MPIRUN, "-hosts", "a:2,b:2", "-np", "4", "prog"]


def test_openmpi_on_one_host_oversubscribes():
    args, _ = launch_command(3, ["prog"], mpirun=MPIRUN, flavour="openmpi")
    assert args == [MPIRUN, "--oversubscribe", "-np", "3", "prog"]


def test_openmpi_with_a_hostfile_and_with_hosts_does_not_bind():
    args, _ = launch_command(4, ["prog"], mpirun=MPIRUN, flavour="openmpi", hostfile="/tmp/h")
    assert args == [MPIRUN, "--hostfile", "/tmp/h", "--bind-to", "none", "-np", "4", "prog"]
    args, _ = launch_command(4, ["prog"], mpirun=MPIRUN, flavour="openmpi", hosts=[Host("a", 2), Host("b", 2)])
    assert args == [MPIRUN, "--host", "a:2,b:2", "--bind-to", "none", "-np", "4", "prog"]


def test_openmpi_as_root_gets_the_run_as_root_variables(monkeypatch):
    monkeypatch.setattr(L.os, "geteuid", lambda: 0)
    _, env = launch_command(2, ["prog"], mpirun=MPIRUN, flavour="openmpi")
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    monkeypatch.setattr(L.os, "geteuid", lambda: 1000)
    assert launch_command(2, ["prog"], mpirun=MPIRUN, flavour="openmpi")[1] == {}


def test_per_rank_logs_go_through_the_wrapper():
    args, _ = launch_command(2, ["prog", "-v"], mpirun=MPIRUN, flavour="mpich", logdir="/logs", python="/py")
    assert args == [MPIRUN, "-np", "2", "/py", "-m", "ringtrain.cluster.rank_log", "/logs", "--", "prog", "-v"]


def test_an_unknown_mpi_cannot_take_a_hostfile():
    with pytest.raises(UsageError, match="cannot tell whether"):
        launch_command(2, ["prog"], mpirun=MPIRUN, flavour="unknown", hostfile="/tmp/h")


def test_the_printed_command_is_one_shell_line():
    line = format_command(["mpirun", "-np", "2", "python", "-c", "print('hi there')"], {"B": "1", "A": "x y"})
    assert line == "A='x y' B=1 mpirun -np 2 python -c 'print('\"'\"'hi there'\"'\"')'"


def test_rank_from_the_launchers_variables():
    assert rank_from_env({"PMI_RANK": "3"}) == 3
    assert rank_from_env({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert rank_from_env({}) is None


# --- dry run: prints, writes nothing ----------------------------------------------

@pytest.fixture
def fake_mpi(monkeypatch, tmp_path):
    """A stand-in mpirun whose flavour the test chooses."""
    mpirun = tmp_path / "mpirun"
    mpirun.write_text("#!/bin/sh\nexit 99\n")
    mpirun.chmod(0o755)
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    # Not root, or Open MPI's run-as-root variables join the printed command; the real user when that is not
    # root, since -o's checks compare the owner of every directory above it with this uid.
    user = os.geteuid() or 1000
    monkeypatch.setattr(L.os, "geteuid", lambda: user)

    def use(flavour):
        monkeypatch.setattr(L, "detect_flavour", lambda path: flavour)
        return str(mpirun)
    return use


@pytest.mark.parametrize("flavour, flag, entries", [
    ("mpich", "-f", ["a:2", "b:1"]),
    ("openmpi", "--hostfile", ["a slots=2", "b slots=1"]),
])
def test_dry_run_prints_the_translated_hostfile_and_command(fake_mpi, tmp_path, flavour, flag, entries):
    mpirun = fake_mpi(flavour)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb:1\n")
    out = io.StringIO()
    logs = tmp_path / "logs"
    code = L.launch(3, ["prog", "x y"], hostfile=str(hostfile), logdir=str(logs), dry_run=True,
                    mpirun=mpirun, stdout=out)
    assert code == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == f"# {logs}/hostfile ({flavour} syntax, from {hostfile}):"
    assert lines[1:3] == [f"#   {e}" for e in entries]
    extra = ["--bind-to none"] if flavour == "openmpi" else []
    expected = " ".join([mpirun, flag, f"{logs}/hostfile", *extra, "-np 3", L.sys.executable,
                         f"-m ringtrain.cluster.rank_log {logs} -- prog 'x y'"])
    assert lines[3:] == [expected]
    assert not logs.exists()


def test_dry_run_without_a_log_directory_names_the_hostfile_as_a_placeholder(fake_mpi, tmp_path):
    mpirun = fake_mpi("mpich")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:2\n")
    out = io.StringIO()
    L.launch(2, ["prog"], hostfile=str(hostfile), dry_run=True, mpirun=mpirun, stdout=out)
    assert out.getvalue().splitlines()[-1] == f"{mpirun} -f HOSTFILE -np 2 prog"


@pytest.mark.parametrize("kwargs, message", [
    (dict(np=0, command=["p"]), "number of processes must be at least 1"),
    (dict(np=2, command=[]), "no command given"),
    (dict(np=2, command=["p"], hostfile="h", host_list="a:2"), "give --hostfile or -H, not both"),
    (dict(np=5, command=["p"], host_list="a:2,b:2"), "-np 5 needs 5 slots"),
])
def test_validation_errors_write_nothing(fake_mpi, tmp_path, kwargs, message):
    mpirun = fake_mpi("mpich")
    logs = tmp_path / "logs"
    with pytest.raises(UsageError, match="^" + message):
        L.launch(mpirun=mpirun, logdir=str(logs), **kwargs)
    assert not logs.exists()


def test_the_launcher_refuses_to_run_inside_an_mpi_job(fake_mpi, monkeypatch):
    mpirun = fake_mpi("mpich")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(UsageError, match="starts mpirun itself"):
        L.launch(2, ["p"], mpirun=mpirun, dry_run=True)


# --- fuzzing ----------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab1.-_:= #\t\nslotsmax_-x0\r"), max_size=60))
def test_the_parser_raises_nothing_but_usage_errors(text):
    try:
        hosts = parse_hostfile(text)
    except UsageError as exc:
        assert "\n" not in str(exc)
    else:
        assert hosts and all(h.slots >= 1 for h in hosts)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_the_parser_raises_nothing_but_usage_errors_on_any_text(text):
    try:
        parse_hostfile(text)
        parse_host_list(text)
    except UsageError:
        pass


hostnames = st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,12}", fullmatch=True)
host_lists = st.lists(st.builds(Host, hostnames, st.integers(1, 64)), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(host_lists, st.sampled_from(["openmpi", "mpich"]))
def test_a_written_hostfile_reads_back_the_same(hosts, flavour):
    assert parse_hostfile(format_hostfile(hosts, flavour)) == hosts


@settings(max_examples=100, deadline=None)
@given(host_lists, st.sampled_from(["openmpi", "mpich"]), st.data())
def test_comments_and_blank_lines_change_nothing(hosts, flavour, data):
    lines = []
    for line in format_hostfile(hosts, flavour).splitlines():
        lines += data.draw(st.lists(st.sampled_from(["", "   ", "# note", "\t# x: slots=0"]), max_size=2))
        lines.append(line + data.draw(st.sampled_from(["", "  ", " # trailing"])))
    assert parse_hostfile("\n".join(lines)) == hosts


# --- one list of rank variables ---------------------------------------------------

def test_one_list_of_rank_variables_serves_the_cli_and_the_log_wrapper(monkeypatch):
    import ringtrain.cli
    import ringtrain.cluster.rank_log
    assert L.RANK_VARIABLES == ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
    assert ringtrain.cluster.rank_log.rank_from_env is L.rank_from_env
    assert L.rank_from_env({"SLURM_PROCID": "5"}) == 5
    # The first variable set decides: one that holds no count is refused naming it, not passed over.
    with pytest.raises(UsageError, match=r"^PMI_RANK='x': must be a whole number >= 0; MPI launchers set it"):
        L.rank_from_env({"PMI_RANK": "x", "PMIX_RANK": "1"})
    assert L.rank_from_env({"PMI_RANK": " ", "PMIX_RANK": "1"}) == 1
    for name in L.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert ringtrain.cli._rank0()
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert not ringtrain.cli._rank0()


def test_an_sbatch_script_may_run_the_launcher_but_mpirun_may_not():
    L.check_request(2, ["p"], env={"SLURM_PROCID": "0"})
    with pytest.raises(UsageError, match="starts mpirun itself"):
        L.check_request(2, ["p"], env={"PMIX_RANK": "0"})


# --- bounds on -np ----------------------------------------------------------------

def test_np_is_bounded_on_one_host_and_oversubscribe_lifts_the_bound():
    assert H.np_limit(2) == 128 and H.np_limit(None) == 64
    H.check_np(128, cpu_count=2)
    with pytest.raises(UsageError, match=r"^-np 129 is more than 128 ranks \(64 per core on this host's 2 cores\)"
                                         r".*--oversubscribe to run them here anyway$"):
        H.check_np(129, cpu_count=2)
    H.check_np(1000, cpu_count=2, oversubscribe=True)


@pytest.mark.parametrize("np", [H.MAX_NP + 1, 99999999999999])
def test_no_flag_lifts_the_ceiling(np):
    with pytest.raises(UsageError, match=f"^-np {np} is above ringtrain launch's limit of {H.MAX_NP} ranks"):
        H.check_np(np, [Host("a", np)], oversubscribe=True)


def test_np_below_one_and_above_the_slots_are_refused():
    with pytest.raises(UsageError, match="^number of processes must be at least 1, got -3$"):
        H.check_np(-3)
    with pytest.raises(UsageError, match="^-np 3 needs 3 slots"):
        H.check_np(3, [Host("a", 2)], cpu_count=64)
    H.check_np(3, [Host("a", 2)], oversubscribe=True)


def test_openmpi_oversubscribes_hosts_only_when_asked():
    args, _ = launch_command(4, ["p"], mpirun=MPIRUN, flavour="openmpi", hosts=[Host("a", 2)], oversubscribe=True)
    assert args == [MPIRUN, "--host", "a:2", "--bind-to", "none", "--oversubscribe", "-np", "4", "p"]


# --- bad files --------------------------------------------------------------------

def test_a_hostfile_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    L.os.mkfifo(fifo)
    with pytest.raises(UsageError, match=r"^cannot read hostfile '.*fifo': it is a FIFO \(named pipe\); "):
        H.read_hostfile(str(fifo))


@pytest.mark.parametrize("path, kind", [("DIR", "a directory"), ("/dev/null", "a character device")])
def test_a_hostfile_that_is_a_directory_or_a_device_is_named(tmp_path, path, kind):
    path = str(tmp_path) if path == "DIR" else path
    with pytest.raises(UsageError, match=f"^cannot read hostfile '{path}': it is {kind}; "):
        H.read_hostfile(path)


def test_a_huge_hostfile_is_refused(tmp_path):
    big = tmp_path / "big"
    big.write_text("node1:1\n" * (H.MAX_HOSTFILE_BYTES // 8 + 1))
    with pytest.raises(UsageError, match="is more than a hostfile's limit of 1,048,576"):
        H.read_hostfile(str(big))


def test_a_log_directory_that_cannot_be_made_is_refused_first(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(UsageError, match=f"^-o {afile}/logs: {afile} is not a directory; choose another"):
        L.check_logdir(str(afile / "logs"))
    with pytest.raises(UsageError, match="exists and is not a directory"):
        L.check_logdir(str(afile))
    L.check_logdir(str(tmp_path / "new" / "logs"))


# --- restarts and failure reports ---------------------------------------------------

@pytest.mark.parametrize("status, done, stopped, expected", [
    (1, 0, False, True), (137, 2, False, True), (1, 3, False, False), (0, 0, False, False),
    (2, 0, False, False), (4, 0, False, False), (127, 0, False, False), (126, 0, False, False), (143, 0, True, False),
])
def test_which_failures_are_restarted(status, done, stopped, expected):
    assert J.should_restart(status, done, 3, stopped) is expected


def test_the_restart_line():
    assert J.restart_line(1, 1, 3, 3.0, rank=1) == \
        "ringtrain launch: job exited with status 1 (rank 1 failed); restart 1 of 3 in 3s"
    assert J.restart_line(9, 2, 2, 0.5) == "ringtrain launch: job exited with status 9; restart 2 of 2 in 0.5s"


def test_restarted_logs_are_read_from_the_last_mark():
    text = "old\nTraceback\nringtrain launch: restart 1\nnew 1\nringtrain launch: restart 2\nnew 2\n"
    assert J.last_run(text) == "new 2\n"
    assert J.last_run("plain\n") == "plain\n"
    assert J.last_run("x\nringtrain launch: restart 3") == ""


def test_the_report_shows_the_first_rank_that_names_an_error():
    lines = [f"step {i}" for i in range(20)]
    logs = {0: "epoch 1\n", 2: "\n".join(lines + ["rank 2: RuntimeError: boom"]), 3: "ringtrain: error: x\n"}
    rank, shown = J.failure_report(logs)
    assert rank == 2 and shown == [(2, lines[-9:] + ["rank 2: RuntimeError: boom"])]


def test_without_an_error_the_report_shows_every_non_empty_log():
    rank, shown = J.failure_report({0: "a\nb\n", 1: "", 2: "c\n"}, lines=1)
    assert rank is None and shown == [(0, ["b"]), (2, ["c"])]
    assert J.format_failure_report("/l", shown) == [
        "ringtrain launch: last 1 line(s) of /l/rank-0.log:", "    b",
        "ringtrain launch: last 1 line(s) of /l/rank-2.log:", "    c"]


def test_an_empty_log_is_said_to_be_empty_not_shown_as_zero_lines():
    # A rank SIGKILLed before it printed: its log is empty, and the report says so in one line.
    rank, shown = J.failure_report({0: "epoch 1\n", 1: ""}, exits={1: (2.0, -9)})
    assert rank == 1 and shown == [(1, [])]
    assert J.format_failure_report("/l", shown) == [
        "ringtrain launch: /l/rank-1.log is empty: rank 1 printed nothing before it ended"]


def test_restarts_append_to_the_rank_logs():
    args, _ = launch_command(2, ["p"], mpirun=MPIRUN, flavour="mpich", logdir="/logs", python="/py", restart=2)
    assert args == [MPIRUN, "-np", "2", "/py", "-m", "ringtrain.cluster.rank_log", "--restart", "2", "/logs", "--", "p"]
    from ringtrain.cluster.rank_log import _parse
    assert _parse(["--restart", "2", "/logs", "--", "p", "-v"]) == (2, "/logs", ["p", "-v"])
    assert _parse(["/logs", "p"]) == (0, "/logs", ["p"])
    assert _parse(["--restart", "x", "/logs", "--", "p"]) is None


@pytest.mark.parametrize("restarts, delay, message", [
    (-1, 3.0, "--restarts must be at least 0, got -1"),
    (1, -1.0, "--restart-delay must be a number of seconds, at least 0, got -1.0"),
    (1, float("nan"), "--restart-delay must be a number of seconds, at least 0, got nan"),
])
def test_restart_flags_are_checked(fake_mpi, restarts, delay, message):
    with pytest.raises(UsageError, match="^" + re.escape(message) + "$"):
        L.launch(2, ["p"], mpirun=fake_mpi("mpich"), restarts=restarts, restart_delay=delay, dry_run=True)


# --- --check ------------------------------------------------------------------------

def test_check_names_a_host_that_does_not_resolve_and_passes_this_machine():
    assert H.check_host("no-such-host.invalid") == \
        "host no-such-host.invalid: does not resolve (check the hostfile or /etc/hosts)"
    assert H.check_host("localhost") is None
    assert H.check_hosts([Host("localhost", 2), Host("x.invalid", 1), Host("localhost", 1)]) == \
        ["host x.invalid: does not resolve (check the hostfile or /etc/hosts)"]
