"""Writes this worker's whole environment as JSON to $OUT_DIR/env_<RANK>.json."""
import json
import os

with open(os.path.join(os.environ["OUT_DIR"], f"env_{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
