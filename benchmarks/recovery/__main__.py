"""`python -m benchmarks.recovery ...` is `benchmarks/recovery/run.py`."""
import sys

from benchmarks.recovery.run import main

sys.exit(main())
