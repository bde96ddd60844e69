"""procprobe.py run from a script whose code names torch.optim, so that the fork server preloads
torch._dynamo for its workers (leto_run.fork_server.preload)."""
import os
import runpy

USES = "torch.optim"    # read by the preload's decision; nothing here imports it
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "procprobe.py"),
               run_name="__main__")
