"""When the fork server may be a fork of the agent (`leto_run.fork_server.inherit`), and the
re-execution that makes the agent's process one: its command line round-trips to what the
user typed, its marker is taken out of the environment, only its own padding is stripped."""
import sys

import pytest

from leto_run.entry import early_refusal
from leto_run.fork_server.inherit import (TITLE_ROOM, original_argv, reexec_argv, refusal,
                                          strip_padding, take_token)

PY = sys.executable


@pytest.mark.parametrize("argv", [
    [PY, "/venv/bin/leto-run", "--nproc-per-node", "2", "train.py", "--lr", "1"],
    [PY, "-m", "leto_run", "--config", "job.yaml"],
    [PY, "-u", "-m", "leto_run", "train.py"],
    [PY, "-u", "/venv/bin/leto-run", "train.py"],
])
def test_the_console_script_and_python_m_are_forked_from(argv):
    assert refusal(argv, PY, PY, "2") is None
    again = reexec_argv(argv, PY)
    assert again[:2] == [PY, "-u"] and again[-TITLE_ROOM:] == [""] * TITLE_ROOM
    assert original_argv(again, reexecuted=True) == argv
    assert original_argv(argv, reexecuted=False) == argv


@pytest.mark.parametrize("argv, why", [
    ([PY, "-O", "-m", "leto_run", "t.py"], "interpreter options (-O -m)"),
    ([PY, "-X", "dev", "/bin/leto-run", "t.py"], "interpreter options (-X dev)"),
    ([PY, "-c", "from leto_run.cli import main; main()", "t.py"], "interpreter options (-c"),
    ([PY, "-m", "other_launcher", "t.py"], "interpreter options (-m other_launcher)"),
    ([PY], "interpreter options ()"),
])
def test_an_interpreter_with_options_of_its_own_is_not(argv, why):
    """A worker is ``python -u <script>``: an agent whose sys.flags differ (or that runs some
    other entry) would hand its flags to every worker."""
    assert why in refusal(argv, PY, PY, "2")


def test_the_other_reasons_name_what_to_change():
    argv = [PY, "-m", "leto_run", "t.py"]
    assert "PYTHON_EXEC" in refusal(argv, PY, "/other/python", "2")
    assert "PYTHON_EXEC" in refusal(argv, "", PY, "2")
    for nproc in ("auto", "gpu", "cpu"):
        assert "OMP_NUM_THREADS" in refusal(argv, PY, PY, nproc)


def test_the_marker_counts_only_with_the_same_token_and_always_leaves_the_environment():
    env = {"LETO_AGENT_EXEC": "abc", "LETO_JOB_TOKEN": "abc", "PATH": "/bin"}
    assert take_token(env) == ("abc", True) and env == {"LETO_JOB_TOKEN": "abc", "PATH": "/bin"}
    # an outer job's token (a nested leto-run) with a stale or forged marker: not re-executed,
    # and (the second value) never to re-execute again
    env = {"LETO_AGENT_EXEC": "abc", "LETO_JOB_TOKEN": "outer"}
    assert take_token(env) == (None, True) and env == {"LETO_JOB_TOKEN": "outer"}
    assert take_token({"LETO_JOB_TOKEN": "outer"}) == (None, False)
    assert take_token({"LETO_AGENT_EXEC": "", "LETO_JOB_TOKEN": ""}) == (None, True)


def test_only_the_whole_padding_is_stripped():
    argv = ["leto-run", "t.py", "x", *[""] * TITLE_ROOM]
    assert strip_padding(argv) and argv == ["leto-run", "t.py", "x"]
    # a script's own empty arguments stay: the padding is exactly TITLE_ROOM of them
    argv = ["leto-run", "t.py", "", *[""] * TITLE_ROOM]
    assert strip_padding(argv) and argv == ["leto-run", "t.py", ""]
    argv = ["leto-run", *[""] * (TITLE_ROOM - 1), "x"]
    assert not strip_padding(argv) and argv[-1] == "x"


# ---- the early re-execution (leto_run.entry) ----------------------------------------------

@pytest.mark.parametrize("orig, argv", [
    ([PY, "-m", "leto_run", "--nproc-per-node", "2", "t.py"],
     ["/x/leto_run/__main__.py", "--nproc-per-node", "2", "t.py"]),
    ([PY, "/bin/leto-run", "t.py", "--lr", "1"], ["/bin/leto-run", "t.py", "--lr", "1"])])
def test_a_job_s_command_line_re_executes_before_the_cli(orig, argv):
    """(`orig`: sys.orig_argv, `argv`: sys.argv, as the interpreter sets them)"""
    assert early_refusal(argv, {}, orig, PY, "auto") is None


@pytest.mark.parametrize("args, env, setting, why", [
    (["t.py"], {}, "off", "LETO_FORK_SERVER=off"),
    (["t.py"], {}, "exec", "LETO_FORK_SERVER=exec"),
    (["t.py"], {}, None, "does not parse"),
    (["--help"], {}, "auto", "the CLI decides"),
    (["--print-config", "t.py"], {}, "auto", "the CLI decides"),
    (["--version"], {}, "auto", "the CLI decides"),
    (["--build-kernels"], {}, "auto", "the CLI decides"),
    (["--no-python", "prog"], {}, "auto", "--no-python"),
    (["t.py"], {"PYTHON_EXEC": "/other/python"}, "auto", "PYTHON_EXEC"),
])
def test_what_the_entry_can_tell_without_the_config_defers_or_refuses(args, env, setting, why):
    """Each refusal is one the CLI's own check (after the config) would make too, or a
    deferral to it: the entry never re-executes where the agent could not use it."""
    argv = [PY, "-m", "leto_run", *args]
    assert why in early_refusal(["leto-run", *args], env, argv, PY, setting)


def test_an_interpreter_with_options_is_refused_early_too():
    argv = [PY, "-X", "dev", "-m", "leto_run", "t.py"]
    assert "interpreter options" in early_refusal(["leto-run", "t.py"], {}, argv, PY, "auto")
