"""Installing a plan on a model: recompute wrappers, segments, op-level policies, offloading, and undoing them."""
