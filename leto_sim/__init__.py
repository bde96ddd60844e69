"""leto_sim: the ETTR simulator of the paper (§8.5, Appendix C), independent of the runtime.

Predicts iteration time (iteration.py), draws seeded failure schedules (failures.py), models
each system's steady state and recovery (systems.py) and measures ETTR over seeds with a
confidence interval, beside the paper's closed-form prediction (ettr.py).  Imports only the
standard library, numpy, pyyaml, click and (for plots) matplotlib -- never the trainer code.
"""
from .config import SimConfig, SimConfigError, load_config, parse_config
from .ettr import SimResult, closed_form_ettr, simulate, simulate_run

__all__ = ["SimConfig", "SimConfigError", "load_config", "parse_config", "SimResult",
           "closed_form_ettr", "simulate", "simulate_run"]
