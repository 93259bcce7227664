"""Runs one case end to end and decides its verdict from what every rank returned."""
