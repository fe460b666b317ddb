"""The pure core (no torch): memory model, exact solver, plans, budgets, profile fits, errors."""
