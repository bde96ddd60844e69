"""Rank given by argv[1] raises under @record (error file with traceback); others wait."""
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == sys.argv[1]:
        time.sleep(0.3)
        raise RuntimeError("boom from the planted rank")
    time.sleep(30)


main()
