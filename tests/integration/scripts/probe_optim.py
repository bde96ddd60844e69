"""procprobe.py from a script whose code names torch.optim, so that the fork server preloads
torch._dynamo for its workers (leto_run.fork_server.preload)."""
USES = "torch.optim"    # read by the preload's decision; nothing here imports it
import procprobe  # noqa: E402,F401 -- the probe runs at its import
