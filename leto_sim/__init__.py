"""leto_sim: the ETTR simulator of the paper (§8.5, Appendix C), independent of the runtime.

Predicts iteration time (iteration.py), draws seeded failure schedules (failures.py), models
each system's steady state and recovery (systems.py) and measures ETTR over seeds with a
confidence interval, beside the paper's closed-form prediction (ettr.py).  Measured runs of the
recovery harness become profiles (profile.py) that validate.py replays against their measured
ETTR; paper.py sets the DeepSeek configs beside the paper's Figures 14 and 15; plots.py draws
the figures.  Imports only the standard library, numpy, pyyaml, click and (for plots)
matplotlib -- never the trainer code.
"""
from .config import SimConfig, SimConfigError, load_config, parse_config
from .ettr import SimResult, closed_form_ettr, simulate, simulate_run, time_to_complete
from .profile import RecoveryProfile, load_profile

__all__ = ["SimConfig", "SimConfigError", "load_config", "parse_config", "SimResult",
           "closed_form_ettr", "simulate", "simulate_run", "time_to_complete",
           "RecoveryProfile", "load_profile"]
