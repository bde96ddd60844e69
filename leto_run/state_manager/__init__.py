"""The state manager: the process that owns one rank slot's retained memory (docs/MEMORY.md).

Run as ``python -m leto_run.state_manager`` (see `__main__`).  What the agent needs:
`FdKeeper` (one per slot, keeps the fds that make a state-manager crash survivable),
`state_manager_argv` and `sm_socket_path`.  Modules: `server` (socket, auth, dispatch), `pool`
(page owners, fds, fault emulation), `metadata` (states, groups, marks), `localize` (failure
localization), `keeper` (the agent-side fd keeper and the state manager's link to it).
"""
from leto_run.state_manager.keeper import (FdKeeper, allow_file_path, keeper_socket_path,
                                           sm_socket_path, state_manager_argv)
from leto_run.state_manager.metadata import Geometry

__all__ = ["FdKeeper", "Geometry", "state_manager_argv", "sm_socket_path", "keeper_socket_path",
           "allow_file_path"]
