"""What the agent, the state managers and the trainers agree on, imported by all three.

- `contract`: the environment contract between `leto-run` and the trainers (variable names,
  signals, exit codes, store keys);
- `settings`: every tuning knob, typed and read in one place;
- `protocol` (with `header`): the state-manager socket protocol, and `bulletin`, the page
  bulletin the state manager publishes;
- `geometry`: the one protection-group `Geometry` (its defaults, its rules, its JSON form, the
  device page rounding);
- `host_pages`: the host page layout (memfd pages mapped back to back) and the CUDA driver
  helpers both sides call;
- `file_trust`: is a path entry ours to use (no symlink, FIFO, other owner, second link);
- `kernel_cache`: the native build helper (the content-addressed cache every kernel build uses).

The state manager (`leto_run/state_manager/`) imports this package and nothing else of
`leto_runtime` (tests/unit/test_structure.py holds it to that).
"""
