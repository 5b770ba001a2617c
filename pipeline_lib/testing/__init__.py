"""Test support: fault injection, example-id records and in-memory doubles. Production code imports it only when its env variable is set."""
