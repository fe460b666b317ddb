"""Reports: where memory goes (breakdown, timeline), budget sweeps and plots, and every rendered table (``render``)."""
