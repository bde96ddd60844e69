"""`python -m leto_run ...` is `leto-run ...` (same entry point, same exit codes)."""
from leto_run.entry import main

if __name__ == "__main__":
    main()
