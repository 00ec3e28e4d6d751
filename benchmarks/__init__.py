"""Strata's benchmarks: scenarios that write a markdown report, results.json and PNG plots.

Run ``python -m benchmarks run SCENARIO``; see benchmarks/README.md. Not part of the test suite.
"""
