"""The application on the top floor: the CLI, the demo and its workflow, benchmarks, `kvbus top`,
the self-test, calibration, model loading and the embedded servers of local runs.

Nothing else in kvbus imports this package.
"""
