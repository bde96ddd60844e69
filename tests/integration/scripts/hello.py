"""Prints one line to stdout and one to stderr, and writes $OUT_DIR/hello_<RANK>."""
import os
import sys

print(f"hello-out rank {os.environ['RANK']}", flush=True)
print(f"hello-err rank {os.environ['RANK']}", file=sys.stderr, flush=True)
open(os.path.join(os.environ["OUT_DIR"], f"hello_{os.environ['RANK']}"), "w").write(" ".join(sys.argv[1:]))
