"""What the agent, the state managers and the trainers agree on, imported by all three.

`geometry`: the one protection-group `Geometry` (its defaults, its rules, its JSON form, the
device page rounding).  The state manager imports this package rather than the trainer's
client modules for what both sides must read the same way.
"""
