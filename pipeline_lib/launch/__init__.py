"""Launching training: the local launcher, its supervisor and watchdog, and the worker entry point."""
