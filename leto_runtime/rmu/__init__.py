"""The Resumable Model Updater (paper §5, docs/RMU.md): crash-consistent AdamW on retained state.

Modules: `adamw` (the arithmetic, bitwise equal to torch.optim.AdamW), `states` (which retained
states exist and how they are laid out), `marker` (the crash-safe progress record), `updater`
(Pseudocode 1: gradient protection, global synchronization, chunk transactions), `chunk_ops`
(a chunk's undo copy, AdamW and parity delta), `side_stream` (its parity loads and write-backs
beside the current stream, CUDA), `cpu_chunks` (its CPU chunk copies and parity deltas,
prepared once and replayed), `recovery`
(resume point across ranks, page repair from a consistent boundary).  `leto_runtime.job` puts
them together for training scripts.
"""
