"""Comparing architectures: the statistics of a study's runs (``stats``)."""
