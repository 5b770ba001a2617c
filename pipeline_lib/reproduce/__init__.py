"""Rerunning a tracked run from its MLflow record and proving its weights come out the same (`tfdag reproduce`)."""
