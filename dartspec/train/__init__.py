"""Training pipelines for drafters."""
