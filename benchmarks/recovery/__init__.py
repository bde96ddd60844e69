"""Recovery time and ETTR: `leto-run` in place next to torchrun + DCP (issue 6).

One run of the harness (`python -m benchmarks.recovery --preset ...`) trains the same GPT under
every system with the same SIGKILL schedule and reports, per failure, the paper's
initialization I and recomputation R, and per run the ETTR against a fault-free reference.

Modules, one job each:
  presets.py  what a machine runs (model, ranks, schedule, budget)
  systems.py  the systems compared: their launcher command lines
  train.py    the training script every system runs (modes ref | dcp | leto)
  launch.py   one system's run: start it, deliver the kills, tear it down
  metrics.py  pure arithmetic on the step logs: I, R, ETTR, Young's interval, extrapolation
  mixed.py    mixed HOF/FF schedules (--mixed): what an FF is per system, its inject spec
  report.py   the Markdown tables and the PASS/MISS lines
  plot.py     the PNG (throughput over time), a separate step that reads the JSON
  run.py      the command line: reference, calibration, systems, JSON
"""
