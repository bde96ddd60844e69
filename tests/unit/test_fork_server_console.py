"""The fork server's own stderr is the agent's console as it was at the fork: when that console
is gone (its reader exited), the server's word there must not end the server.  A real process
whose stderr is a pipe with no reader left."""
import os
import subprocess
import sys

from leto_testing import ROOT

PROBE = """
import sys
from leto_run.fork_server.server import say
say("[leto-run fork-server] the agent's socket failed: x" * 4096 + "\\n")
say("again\\n")
print("survived", flush=True)
"""


def test_a_fork_server_word_on_a_gone_console_is_dropped():
    r, w = os.pipe()
    os.close(r)                                 # the console's reader is gone: EPIPE
    try:
        p = subprocess.run([sys.executable, "-c", PROBE], cwd=str(ROOT), stderr=w,
                           stdout=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stdout == "survived\n", (p.returncode, p.stdout)
