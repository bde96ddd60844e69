"""Resumable Model Updater (DESIGN.md §6): transactional, chunked optimizer updates."""
