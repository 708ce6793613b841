"""The front door: one request core (validation, admission, policy, cost model, balancing,
streaming) behind the gRPC servicer and the HTTP app; the Ray pools it drives; the CLI.

Ray fixes the address it listens on when it is first imported. Unless a cluster address is given
(RAY_ADDRESS), pdserve runs Ray on this machine alone, so every Ray socket should bind 127.0.0.1:
the two variables below say so, and they are set here, before anything in router imports ray.
"""

import os

if "RAY_ADDRESS" not in os.environ:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
