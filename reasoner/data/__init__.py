"""Datasets (generated arithmetic, local files, GSM8K), prompt templates and the grain pipeline."""
