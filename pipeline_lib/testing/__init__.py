"""Test support: fault injection and in-memory doubles. Production code imports it only when its env variable is set."""
