"""The fork server: trainers and shadows forked from a process that has already imported torch.

Why: `import torch` costs seconds of CPU per process, paid again by every trainer, every shadow
and every replacement a recovery starts.  The agent starts one fork server per node: a fork of
the agent right after its own `import torch` (`inherit`), or, where the agent's process is not
what a worker's would be, an exec'd one that imports torch itself; either has torch (and nothing
else of the job: no CUDA, no threads of its own), and forks a worker per request.  The worker
is adopted by the agent (its child-subreaper), so the agent waits on it, signals it and reads
its exit status exactly as for a process it spawned itself.

The processes (docs/ARCHITECTURE.md, "The process tree"):

    agent --fork (or spawn)--> fork server --fork--> intermediate --fork--> worker
      ^                                                   (exits at once)       |
      +------------------ adopts the worker (child subreaper) -------------------+

Modules: `client` (the agent's side: start, requests, the pure `refusal` decision that sends a
request the fork server cannot serve to a plain spawn), `inherit` (the agent's re-execution and
the server forked from it, with its own pure `refusal`), `server` (the fork server's loop and a
new worker's process set-up), `preload` (what the server imports after torch, decided from the
training script's code), `child` (a worker runs its command line as the interpreter would),
`wire` (framed JSON with file descriptors over a socket pair).
"""
