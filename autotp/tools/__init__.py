"""Tools around plans: the CLI, reports, the demo, calibration, comparison with hand-written plans."""
